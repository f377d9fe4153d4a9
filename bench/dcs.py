"""DCS on Fashion-MNIST: search + materialize the dense base, then measure what the compact model buys.

Records dense accuracy and FLOPs; the searched+materialized model's FLOPs, parameters, file size and
accuracy before retraining; the throughput ratio against dense at batch 64 (and latency at batch 1)
measured interleaved in one process on CPU; and the search's time per epoch against a dense
training epoch on the same number of images (both measured here, one after the other).

    /work/venv/bin/python bench/dcs.py --base runs/base --search runs/dcs_search_r32 \
        --mat runs/dcs_mat_r32 --epochs 4 --train-limit 24000 --target-flops 0.6 --arch-lr 0.05 \
        --round-mlp 32 --iters 40 --paper-search runs/dcs_search_v3 --also-input

(runs/dcs_search_v3: the same search without --round-mlp, made with ``nascompress search dcs``.)
Writes bench/results/dcs.json. The search uses the static Q/K mask (the one that can be removed
physically); the input-dependent variant is measured for FLOPs and speed only (``--also-input``).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.api import evaluate_run, run_data_config  # noqa: E402
from nascompress.data import InputSpec, load_data  # noqa: E402
from nascompress.io import load_with_arch  # noqa: E402
from nascompress.materialize import MaterializeJob, materialize, materialize_search  # noqa: E402
from nascompress.methods.dcs import DCSConfig, make_supernet  # noqa: E402
from nascompress.profiling import count_flops, measure  # noqa: E402
from nascompress.search import DCSSearchConfig, DCSSearchJob, search_dcs  # noqa: E402
from nascompress.train import TrainConfig, fit  # noqa: E402
from nascompress.utils import write_json  # noqa: E402
from _common import wait_for_base  # noqa: E402


def dense_epoch_time(base: Path, data_cfg, *, batch_size: int, seed: int) -> float:
    """Seconds of one dense training epoch (shared engine) on the same images the search used."""
    model, arch = load_with_arch(base)
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(data_cfg, img_size=spec.img_size)
    with tempfile.TemporaryDirectory() as tmp:
        m = fit(model, data=data, input_spec=spec, cfg=TrainConfig(epochs=1, batch_size=batch_size, warmup_epochs=0,
                                                                   seed=seed, device="cpu"),
                out_dir=Path(tmp), arch=arch)
    return m["train_time_s"]


def interleaved_step_ratio(base: Path, job: DCSSearchJob, *, rounds: int) -> dict:
    """Search steps vs dense training steps on the same batches, interleaved in this process.

    Each round times 10 dense steps (forward, backward, AdamW) and 10 search steps in the search's
    7:3 mix of W-steps and alpha-steps (same code as the search), on the same 10 batches; the
    ratio of the two totals is the search epoch / dense epoch ratio on equal data, free of the
    machine's drift between two epochs measured minutes apart.
    """
    from nascompress.data import make_loader, preprocess
    from nascompress.methods.dcs import arch_parameters
    from nascompress.search.dcs import CostModel, _interleave, step_loss

    dense, arch = load_with_arch(base)
    spec = InputSpec.from_dict(arch["input"])
    sup = make_supernet(copy.deepcopy(dense), job.method, tau=job.search.tau0)
    cost = CostModel.build(dense, sup, torch.zeros(1, spec.in_chans, *spec.img_size))
    a_params = arch_parameters(sup)
    w_params = [p for p in sup.parameters() if all(p is not a for a in a_params)]
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-4)
    opt_w, opt_a = torch.optim.AdamW(w_params, lr=1e-4), torch.optim.AdamW(a_params, lr=1e-3)
    data = load_data(job.data, img_size=spec.img_size)
    loader = make_loader(data.train, batch_size=job.search.batch_size, shuffle=True, seed=0, drop_last=True)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # cycles through the split
    kinds = _interleave(7, 3)
    t_dense = t_search = 0.0
    dense.train()
    sup.train()
    for r in range(rounds + 1):  # round 0 warms up
        bs = [next(batches) for _ in range(10)]
        xs, ys = [preprocess(imgs, spec) for imgs, _ in bs], [labels for _, labels in bs]
        t0 = time.perf_counter()
        for x, y in zip(xs, ys):
            loss = torch.nn.functional.cross_entropy(dense(x), y)
            opt_d.zero_grad()
            loss.backward()
            opt_d.step()
        t1 = time.perf_counter()
        for x, y, kind in zip(xs, ys, kinds):
            for p in w_params:
                p.requires_grad_(kind == "w")
            for p in a_params:
                p.requires_grad_(kind == "a")
            loss, _ = step_loss(sup, x, y, kind=kind, cost=cost, lam=0.5, cfg=job.search)
            opt_w.zero_grad()
            opt_a.zero_grad()
            loss.backward()
            (opt_w if kind == "w" else opt_a).step()
        t2 = time.perf_counter()
        if r:
            t_dense, t_search = t_dense + t1 - t0, t_search + t2 - t1
    return {"rounds": rounds, "dense_steps_s": t_dense, "search_steps_s": t_search, "ratio": t_search / t_dense}


def speed(dense, compact, input_shape, iters: int) -> dict:
    t = measure([dense, compact], input_shape, device=torch.device("cpu"), batch_sizes=(1, 64), iters=iters, warmup=5)
    return {"dense": t[0], "compact": t[1], "throughput_speedup_batch64": t[1]["throughput"] / t[0]["throughput"],
            "latency_speedup_batch1": t[0]["latency_ms"] / t[1]["latency_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--search", default="runs/dcs_search")
    ap.add_argument("--mat", default="runs/dcs_mat")
    ap.add_argument("--out", default="bench/results/dcs.json")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--train-limit", type=int, default=24000)
    ap.add_argument("--target-flops", type=float, default=0.6)
    ap.add_argument("--arch-lr", type=float, default=0.05)
    ap.add_argument("--qk-mask", default="static")
    ap.add_argument("--round-mlp", type=int, default=32, help="Close MLPs with < K channels (0: the paper as is).")
    ap.add_argument("--paper-search", default=None,
                    help="A finished search without --round-mlp to materialize and time as well.")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--step-rounds", type=int, default=6, help="Rounds of 10+10 interleaved training steps.")
    ap.add_argument("--skip-search", action="store_true", help="Reuse an existing finished --search.")
    ap.add_argument("--also-input", action="store_true", help="Also measure the input-dependent Q/K variant.")
    ap.add_argument("--wait-s", type=float, default=3600)
    args = ap.parse_args()
    base, search_dir, mat_dir = Path(args.base), Path(args.search), Path(args.mat)
    wait_for_base(base, args.wait_s)
    res: dict = {"machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                             "torch": torch.__version__},
                 "command": " ".join(sys.argv)}

    # Dense reference.
    dense, arch = load_with_arch(base)
    spec = InputSpec.from_dict(arch["input"])
    x1 = torch.zeros(1, spec.in_chans, *spec.img_size)
    dense_flops = count_flops(dense, x1)
    dense_test = evaluate_run(base, device="cpu")
    res["dense"] = {"dir": str(base), "macs": dense_flops.total, "params": dense_flops.params,
                    "test_top1": dense_test["top1"], "test_n": dense_test["n"],
                    "file_bytes": (base / "model.safetensors").stat().st_size}

    # Search (static Q/K so the masks can be removed physically), then materialize.
    data_cfg = replace(run_data_config(base), train_limit=args.train_limit)
    search_cfg = DCSSearchConfig(epochs=args.epochs, target_flops=args.target_flops, arch_lr=args.arch_lr,
                                 round_mlp=args.round_mlp, device="cpu")
    job = DCSSearchJob(source=str(base), out=str(search_dir), method=DCSConfig(qk_mask=args.qk_mask),
                       search=search_cfg, data=data_cfg)
    if not args.skip_search:
        search_dcs(job, force=True)
    search_metrics = json.loads((search_dir / "metrics.json").read_text())
    log = [json.loads(ln) for ln in (search_dir / "log.jsonl").read_text().splitlines() if ln]
    mat_metrics = materialize_search(MaterializeJob(search_dir=str(search_dir), out=str(mat_dir)), force=True)
    compact = nascompress.load(mat_dir)
    mat_test = evaluate_run(mat_dir, device="cpu")
    sup_test = evaluate_run(search_dir, device="cpu")
    res["search"] = {"dir": str(search_dir), "job": job.to_dict(), "train_images": search_metrics["train_images"],
                     "flops_ratio": search_metrics["flops_ratio"], "target_flops": args.target_flops,
                     "within_5pct": abs(search_metrics["flops_ratio"] / args.target_flops - 1) <= 0.05,
                     "calibrated": search_metrics["calibrated"], "final_lambda": search_metrics["lam"],
                     "supernet_test_top1": sup_test["top1"], "epoch_time_s": search_metrics["epoch_time_s"],
                     "log": log}
    flops = count_flops(compact, x1)
    res["materialized"] = {"dir": str(mat_dir), "macs": flops.total, "params": flops.params,
                           "test_top1_before_retraining": mat_test["top1"],
                           "file_bytes": (mat_dir / "model.safetensors").stat().st_size,
                           "max_abs_logit_diff_vs_supernet": mat_metrics["max_abs_logit_diff"],
                           "mlp_kept": mat_metrics["mlp_kept"], "qk_kept": log[-1].get("qk_kept"),
                           "flops_ratio_dense_over_compact": dense_flops.total / flops.total,
                           "params_ratio": dense_flops.params / flops.params}

    # Throughput, interleaved in this process; the claim: speedup >= 0.8 x FLOPs ratio.
    sp = speed(dense, compact, (spec.in_chans, *spec.img_size), args.iters)
    fr = dense_flops.total / flops.total
    sp.update(flops_ratio=fr, required_speedup=0.8 * fr, passes=sp["throughput_speedup_batch64"] >= 0.8 * fr)
    res["speed"] = sp

    if args.paper_search:  # the same search without block rounding: channels spread over the blocks
        with tempfile.TemporaryDirectory() as tmp:
            pm = materialize_search(MaterializeJob(search_dir=args.paper_search, out=str(Path(tmp) / "m")), force=True)
            p_model = nascompress.load(Path(tmp) / "m")
        sp_p = speed(dense, p_model, (spec.in_chans, *spec.img_size), args.iters)
        fr_p = dense_flops.total / pm["macs"]
        res["without_round_mlp"] = {
            "search_dir": args.paper_search, "mlp_kept": pm["mlp_kept"], "macs": pm["macs"], "flops_ratio": fr_p,
            "supernet_test_top1": evaluate_run(args.paper_search, device="cpu")["top1"],
            "throughput_speedup_batch64": sp_p["throughput_speedup_batch64"], "required_speedup": 0.8 * fr_p,
            "calibrated": json.loads((Path(args.paper_search) / "metrics.json").read_text())["calibrated"]}

    if args.also_input:  # the paper's input-dependent Q/K mask, same MLP selection: runtime mask kept
        sup, _ = load_with_arch(search_dir)
        cfg_in = DCSConfig(qk_mask="input")
        sup_in = make_supernet(copy.deepcopy(dense), cfg_in).eval()
        with torch.no_grad():
            for b_in, b in zip(sup_in.blocks, sup.blocks):
                b_in.dcs_alpha.copy_(b.dcs_alpha)
        m_in, _ = materialize(sup_in, cfg_in)
        f_in = count_flops(m_in, x1)
        sp_in = speed(dense, m_in, (spec.in_chans, *spec.img_size), args.iters)
        res["input_dependent_variant_same_mlp"] = {
            "macs": f_in.total, "params": f_in.params, "flops_ratio": dense_flops.total / f_in.total,
            "throughput_speedup_batch64": sp_in["throughput_speedup_batch64"],
            "note": "theta Linear kept at run time (counted); untrained theta, speed/FLOPs only"}

    # Search epoch vs dense training epoch on the same number of images.
    t_dense = dense_epoch_time(base, data_cfg, batch_size=search_cfg.batch_size, seed=search_cfg.seed)
    t_search = sorted(search_metrics["epoch_time_s"])[len(search_metrics["epoch_time_s"]) // 2]
    res["search_epoch_vs_dense_epoch"] = {
        "images": search_metrics["train_images"], "dense_epoch_s": t_dense, "search_epoch_s_median": t_search,
        "ratio_of_epochs": t_search / t_dense,
        "interleaved_steps": interleaved_step_ratio(base, job, rounds=args.step_rounds)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)
    summary = {k: res[k] for k in ("dense", "materialized", "speed", "search_epoch_vs_dense_epoch")}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
