"""Retraining a compressed model with CE only vs CE + eta * IBB (DCS paper, Algorithm 1, Table 4).

Starts from the materialized DCS model (about 40% fewer FLOPs than the dense base) and retrains
it twice with the same epochs, data and seed: eta = 0 (CE only) and eta = 50 (CE + eta * IBB after
a 30% warm-up). Reports, next to the dense base: test top-1, the IB loss I(X~;X) - I(X~;Y) of
every model measured the same way (the paper's Table 4 shape), and K-means time vs epoch time.

    python bench/ib_retrain.py --model runs/dcs_mat_r32 --dense runs/base --epochs 4 --train-limit 30000 \
        --cluster-samples 5000 --eval-limit 3000 --threads 2

Writes bench/results/ib_retrain.json (``--out``; runs go to ``--runs``, default runs/bench_ib/, which git ignores).
Every test top-1 is on the same test images (``--test-limit``: a seeded class-stratified subset).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from _common import ROOT, data_sizes, header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.profiling.jobs import evaluate_run
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data, preprocess  # noqa: E402
from nascompress.runs.io import load_arch, load_with_arch  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.dcs_search.ib_hooks import IBHooks, make_input_embed
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.run import RetrainJob, retrain  # noqa: E402
from nascompress.train.config import TrainConfig  # noqa: E402


def wait_for(path: Path, deadline: dt.datetime) -> bool:
    while not (path / "model.safetensors").is_file() or not (path / "arch.json").is_file():
        if dt.datetime.now(dt.timezone.utc) >= deadline:
            return False
        time.sleep(30)
    time.sleep(5)  # let the writer finish metrics/config files
    return True


def measure_ib(run_dir: Path, data, cfg: RetrainConfig, seed: int) -> dict:
    """IB loss of a saved model on the cluster subset of the training split (same X clusters for all)."""
    model, arch = load_with_arch(run_dir)
    hooks = IBHooks(
        cfg,
        train_set=data.train,
        input_spec=InputSpec.from_dict(arch["input"]),
        num_classes=data.num_classes,
        epochs=1,
        input_embed=make_input_embed(cfg, model=model, teacher=None),
        seed=seed,
    )
    s = hooks.refresh(model, epoch=-1)
    return {
        k: s[k]
        for k in ("ib", "i_xt_x", "i_xt_y", "ibb_full", "train_top1_eval", "cluster_n", "kmeans_s", "feature_pass_s")
    }


def flops_of(run_dir: Path, data) -> float:
    model, arch = load_with_arch(run_dir)
    imgs, _ = data.test.__getitems__(list(range(8)))
    return count_flops(model, preprocess(imgs, InputSpec.from_dict(arch["input"]))).total


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "runs/dcs_mat"), help="the compressed model to retrain")
    p.add_argument("--dense", default=str(ROOT / "runs/base"), help="the dense base run")
    p.add_argument("--dataset", default=None, help="default: the dense run's")
    p.add_argument("--data-dir", default=None, help="default: the dense run's")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-limit", type=int, default=20000)
    p.add_argument("--eval-limit", type=int, default=2000, help="val images used during retraining")
    p.add_argument("--test-limit", type=int, default=None, help="test images for the table (None: all 10k)")
    p.add_argument("--cluster-samples", type=int, default=10000)
    p.add_argument("--eta", type=float, default=50.0)
    p.add_argument("--warmup-frac", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=3e-4, help="absolute peak lr (nascompress retrain's default)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="training seed and the seed of the data subsets")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--keep",
        default="best",
        choices=["best", "last"],
        help="save the best validation epoch (fit's default; may be a CE-only warm-up epoch) or the last",
    )
    p.add_argument("--runs", default=str(ROOT / "runs/bench_ib"))
    p.add_argument("--wait-until", default=None, help="UTC HH:MM: poll for --model until then")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on a contended CPU)")
    p.add_argument("--out", default=str(ROOT / "bench/results/ib_retrain.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(a.threads, os.cpu_count() or 1)))
    model_dir, dense_dir, runs = Path(a.model), Path(a.dense), Path(a.runs)
    result: dict = {
        **header(),
        "model": str(model_dir),
        "dense": str(dense_dir),
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
    }
    if a.wait_until:
        hh, mm = map(int, a.wait_until.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        deadline = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
        if not wait_for(model_dir, deadline):
            result.update(status="not run", reason=f"{model_dir} did not appear by {a.wait_until} UTC")
            save(a.out, result)
            print(json.dumps(result, indent=2))
            return result
    base_data = run_data_config(dense_dir) or DataConfig()
    if a.dataset is not None:
        base_data = replace(base_data, dataset=a.dataset)
    if a.data_dir is not None:
        base_data = replace(base_data, data_dir=a.data_dir)
    # limits are seeded class-stratified subsets: the same seed draws the same images for every row
    data_cfg = replace(base_data, train_limit=a.train_limit, eval_limit=a.eval_limit, subset_seed=a.seed)
    full_eval = replace(base_data, train_limit=a.train_limit, eval_limit=a.test_limit, subset_seed=a.seed)
    spec = InputSpec.from_dict(load_arch(model_dir)["input"])
    data = load_data(data_cfg, spec=spec)
    ib_cfg = RetrainConfig(eta=a.eta, warmup_frac=a.warmup_frac, cluster_samples=a.cluster_samples)
    train_cfg = TrainConfig(
        epochs=a.epochs,
        batch_size=a.batch_size,
        lr=a.lr,
        min_lr=min(1e-6, a.lr),
        warmup_epochs=0.2,
        seed=a.seed,
        device=a.device,
        keep=a.keep,
    )

    rows = {}
    for label, run_dir in (("dense base", dense_dir), ("compressed, before retraining", model_dir)):
        t0 = time.perf_counter()
        test = evaluate_run(run_dir, data=full_eval, device="cpu")
        rows[label] = {
            "run": str(run_dir),
            "macs_per_image": flops_of(run_dir, data),
            "test_top1": test.top1,
            "test_n": test.n,
            **measure_ib(run_dir, data, ib_cfg, a.seed),
            "measure_s": time.perf_counter() - t0,
        }
        print(label, json.dumps(rows[label]), flush=True)
    retrained = {}
    for label, eta in (("retrained, CE only", 0.0), (f"retrained, CE + {a.eta:g} IBB", a.eta)):
        out = runs / ("ce" if eta == 0 else "ce_ibb")
        job = RetrainJob(
            model_dir=str(model_dir),
            out=str(out),
            data=data_cfg,
            train=train_cfg,
            retrain=ib_cfg.replace(eta=eta),
            auto_batch=False,
        )
        t0 = time.perf_counter()
        m = retrain(job, force=True)
        wall = time.perf_counter() - t0
        log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines() if ln.strip()]
        test = evaluate_run(out, data=full_eval, device="cpu")
        rows[label] = {
            "run": str(out),
            "macs_per_image": flops_of(out, data),
            "test_top1": test.top1,
            "test_n": test.n,
            **measure_ib(out, data, ib_cfg, a.seed),
        }
        retrained[label] = {
            "eta": eta,
            "warm_epochs": m.warm_epochs,
            "best_val_top1": m.best_val_top1,
            "best_epoch": m.best_epoch,
            "start_val_top1": m.start_val_top1,
            # fit keeps the best validation epoch: did the saved model train with IBB at all?
            "saved_epoch_trained_with_ibb": eta > 0 and m.best_epoch > m.warm_epochs,
            "test_top1_fit": m.test_top1,
            "wall_s": wall,
            "epoch_time_s_mean": m.epoch_time_s_mean,
            "kmeans_s_mean": m.kmeans_s_mean,
            "feature_pass_s_mean": m.feature_pass_s_mean,
            "kmeans_vs_epoch": m.kmeans_vs_epoch,
            "log": [
                {
                    k: r.get(k)
                    for k in (
                        "epoch",
                        "start",
                        "ib_active",
                        "train_ce",
                        "train_ibb",
                        "ib",
                        "i_xt_x",
                        "i_xt_y",
                        "train_top1_eval",
                        "val_top1",
                        "epoch_time_s",
                        "kmeans_s",
                        "feature_pass_s",
                    )
                }
                for r in log
            ],
        }
        print(label, json.dumps(rows[label]), flush=True)
    dense_top1 = rows["dense base"]["test_top1"]
    dense_macs = rows["dense base"]["macs_per_image"]
    for r in rows.values():
        r["flops_ratio_vs_dense"] = r["macs_per_image"] / dense_macs
        r["top1_minus_dense"] = r["test_top1"] - dense_top1
        r["within_1pt_of_dense"] = r["test_top1"] >= dense_top1 - 1.0
    result.update(
        status="ok",
        setup={
            "data": data_sizes(data, data_cfg),
            "test_data": data_sizes(load_data(full_eval, spec=spec), full_eval),
            "train_images": len(data.train),
            "val_images": len(data.val),
            "test_images": rows["dense base"]["test_n"],
            "epochs": a.epochs,
            "keep": a.keep,
            "seed": a.seed,
            "lr": a.lr,
            "batch_size": a.batch_size,
            "eta": a.eta,
            "warmup_frac": a.warmup_frac,
            "cluster_samples": a.cluster_samples,
            "device": a.device,
            "torch_threads": torch.get_num_threads(),
            **ib_cfg.describe(teacher=False),
            "ib_measured_on": "the same fixed random subset of the training split for every model, "
            "A = B = classes clusters, input clusters identical for all rows",
        },
        table4=[
            {
                "model": k,
                "flops_ratio_vs_dense": v["flops_ratio_vs_dense"],
                "test_top1": v["test_top1"],
                "ib_loss": v["ib"],
                "i_xt_x": v["i_xt_x"],
                "i_xt_y": v["i_xt_y"],
            }
            for k, v in rows.items()
        ],
        rows=rows,
        retrain=retrained,
        finished_utc=dt.datetime.now(dt.timezone.utc).isoformat(),
    )
    save(a.out, result)
    print(json.dumps(result["table4"], indent=2))
    return result


if __name__ == "__main__":
    main()
