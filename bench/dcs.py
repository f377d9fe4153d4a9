"""DCS on Fashion-MNIST: search + materialize the dense base, then measure what the compact model buys,
and compare it with uniform magnitude pruning (the Torch-Pruning-style baseline) at the same FLOPs.

Records:

* the dense base: test top-1, FLOPs, params, file size;
* the search (static Q/K mask, the one that can be removed physically): the FLOPs ratio it landed
  on by itself, whether it needed the threshold calibration and by how much (``calibrated``,
  ``calibration``: the ratio before it and the alpha shift), the final ratio, lambda, the per-block
  kept MLP channels and per-head kept Q/K channels, the supernet's test top-1, its epoch times;
* the materialized model: FLOPs, params, file size, test top-1 before retraining, the per-block
  kept MLP channels and per-head Q/K counts (and each block's padded Q/K width), its logit
  difference to the masked supernet;
* throughput at batch 64 and latency at batch 1 against dense, measured interleaved in one process
  on CPU (``nascompress.profiling.measure``);
* ``--compare-uniform``: uniform pruning (``methods.uniform``: every block keeps the same share of
  its MLP hidden neurons and of each head's Q/K channels, by weight magnitude) at the FLOPs ratio
  of the DCS-materialized model (``keep_for_flops``); both are then retrained with the same budget
  (``nascompress.retraining.run`` with eta = 0: same epochs, images, seed, lr, optional teacher) and their
  test top-1, FLOPs, params and throughput against dense (the three models interleaved) are
  reported, with which one wins;
* a search epoch against a dense training epoch on the same images (both measured here, one after
  the other), and the same comparison free of the machine's drift: search steps and dense training
  steps interleaved on the same batches (``--step-rounds``; see :func:`interleaved_step_ratio`);
* optionally the same search without ``--round-mlp`` (``--paper-search``) and the input-dependent
  Q/K variant (``--also-input``, FLOPs and speed only).

    python bench/dcs.py --base runs/base --search runs/dcs_search_r32 --mat runs/dcs_mat_r32 \
        --qk-mask static --epochs 4 --train-limit 24000 --target-flops 0.6 --arch-lr 0.05 --round-mlp 32 \
        --iters 40 --paper-search runs/dcs_search_v3 --also-input \
        --compare-uniform --uniform runs/uniform_r32 --retrain-epochs 4 --retrain-limit 30000

Writes bench/results/dcs.json (``--out``). ``--paper-search DIR`` reuses a finished search there
(made with ``nascompress search dcs`` without --round-mlp), else runs it (the same job, --round-mlp 0).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import data_sizes, header, save, uniform_summary, wait_for_base  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402  (torchvision CPU fix before timm)
from nascompress.profiling.jobs import evaluate_run
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data, make_loader, preprocess  # noqa: E402
from nascompress.train.hooks import TrainHooks  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.methods.dcs import DCSConfig, make_supernet, materialize  # noqa: E402
from nascompress.methods.uniform import uniform_at_flops  # noqa: E402
from nascompress.profiling import count_flops, measure  # noqa: E402
from nascompress.pyapi.common import write_run  # noqa: E402
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.run import RetrainJob, retrain  # noqa: E402
from nascompress.dcs_search import search_dcs  # noqa: E402
from nascompress.dcs_search.cost import CostModel
from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config
from nascompress.dcs_search.hooks import DCSSearchHooks  # noqa: E402
from nascompress.dcs_search.materialize import MaterializeJob, materialize_search  # noqa: E402
from nascompress.train.config import TrainConfig
from nascompress.train.loop import fit  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Time: search vs dense training


def _optimizer(model: torch.nn.Module, hooks: TrainHooks, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the hooks' parameter groups at their peak lr (as fit builds it; no schedule)."""
    peak = cfg.peak_lr
    groups = hooks.param_groups(model, cfg)
    for g in groups:
        g["lr"] = g["own_lr"] if "own_lr" in g else peak * g.get("lr_scale", 1.0)
    return torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.999))


def _step(model, opt, hooks: TrainHooks, x, y, tag, cfg: TrainConfig) -> None:
    """One training step exactly as fit's loop runs it (without the lr schedule and progress bar)."""
    hooks.prepare_step(model, tag)
    loss, _ = hooks.loss(model, x, y, epoch=0, cfg=cfg, tag=tag)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip)
    opt.step()
    hooks.after_step(model, tag)


def interleaved_step_ratio(
    job: DCSSearchJob, dense: torch.nn.Module, arch: dict, spec: InputSpec, data, *, rounds: int, steps: int = 10
) -> dict[str, Any]:
    """Search steps vs dense training steps on the same batches, interleaved in this process.

    The search side is the real search step: :class:`DCSSearchHooks` (built as ``search_dcs``
    builds it, distillation teacher included) draws the epoch's batches in its own order of
    W-steps (70% split) and arch-steps (30% split), and every step runs ``prepare_step``, ``loss``,
    backward, gradient clipping, the AdamW step and ``after_step`` (the lambda controller), as fit
    does. The dense side trains a copy of the dense model with the default cross-entropy hooks on
    the very same images. Each round times ``steps`` steps of each, the order of the two
    alternating between rounds; round 0 warms up. The ratio of the totals is the search-epoch /
    dense-epoch ratio on equal data, free of the machine's drift between two epochs measured
    minutes apart. (The lr schedule is left out of both: it is a handful of scalar assignments.)
    """
    cfg = job.train
    sup = make_supernet(copy.deepcopy(dense), job.method, tau=job.search.tau0)
    cost = CostModel.build(dense, sup, torch.zeros(1, spec.in_chans, *spec.img_size))
    teacher = copy.deepcopy(dense).eval().requires_grad_(False)
    hooks = DCSSearchHooks(
        sup,
        dense=teacher if job.search.distill > 0 else None,
        cost=cost,
        job=job,
        base_arch=arch,
        train_size=len(data.train),
    )
    student, plain = copy.deepcopy(dense), TrainHooks()
    opt_s, opt_d = _optimizer(sup, hooks, cfg), _optimizer(student, plain, cfg)

    def loader_for(epoch: int):
        return lambda ds, stream=0: make_loader(
            ds, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed + stream, epoch=epoch
        )

    def stream():
        for epoch in itertools.count():
            hooks.on_epoch_start(sup, epoch=0)  # the first epoch's temperature throughout
            it, n = hooks.batches(data, epoch=epoch, loader=loader_for(epoch))
            hooks.steps_per_epoch = n
            yield from it

    batches = stream()
    sup.train()
    student.train()
    t_dense = t_search = 0.0
    kinds = {"w": 0, "a": 0}
    for r in range(rounds + 1):
        bs = [(preprocess(imgs, spec), labels, kind) for imgs, labels, kind in itertools.islice(batches, steps)]

        def run_search() -> float:
            t0 = time.perf_counter()
            for x, y, kind in bs:
                _step(sup, opt_s, hooks, x, y, kind, cfg)
            return time.perf_counter() - t0

        def run_dense() -> float:
            t0 = time.perf_counter()
            for x, y, _ in bs:
                _step(student, opt_d, plain, x, y, None, cfg)
            return time.perf_counter() - t0

        if r % 2:
            ts, td = run_search(), run_dense()
        else:
            td, ts = run_dense(), run_search()
        if r:
            t_dense, t_search = t_dense + td, t_search + ts
            for _, _, kind in bs:
                kinds[kind] += 1
    for p in sup.parameters():
        p.requires_grad_(True)
    return {
        "rounds": rounds,
        "steps_per_round": steps,
        "batch_size": cfg.batch_size,
        "w_steps": kinds["w"],
        "arch_steps": kinds["a"],
        "distill_teacher_forward_on_w_steps": job.search.distill > 0,
        "dense_steps_s": t_dense,
        "search_steps_s": t_search,
        "ratio": t_search / t_dense if t_dense else None,
        "how": "DCSSearchHooks steps (prepare_step, loss, backward, clip, AdamW, after_step) vs dense CE steps "
        "on the same batches, alternating order per round, round 0 warm-up",
    }


def dense_epoch_time(
    dense: torch.nn.Module, arch: dict, spec: InputSpec, data_cfg: DataConfig, train_cfg: TrainConfig
) -> dict[str, Any]:
    """Seconds of one dense training epoch (fit) on the images the search trained on, with the
    search's optimisation settings (batch, lr groups, clipping); validation not timed."""
    data = load_data(replace(data_cfg, eval_limit=min(data_cfg.eval_limit or 500, 500)), spec=spec)
    cfg = train_cfg.replace(epochs=1, eval_start=False, keep="last")
    with tempfile.TemporaryDirectory() as tmp:
        m = fit(copy.deepcopy(dense), data=data, input_spec=spec, cfg=cfg, out_dir=Path(tmp), arch=arch)
    return {"dense_epoch_s": m.train_time_s, "images": len(data.train), "batch_size": cfg.batch_size}


# ---------------------------------------------------------------------------------------------
# Speed and records


def speed(models: list[torch.nn.Module], labels: list[str], input_shape, iters: int) -> dict[str, Any]:
    """Latency (batch 1) and throughput (batch 64) of every model, interleaved in this process; the
    first is the reference of the ratios."""
    t = measure(models, tuple(input_shape), device=CPU, batch_sizes=(1, 64), iters=iters, warmup=5)
    out: dict[str, Any] = {"iters": iters, "timings": dict(zip(labels, t))}
    for lab, ti in zip(labels[1:], t[1:]):
        out[lab] = {
            "throughput_speedup_batch64": ti["throughput"] / t[0]["throughput"],
            "latency_speedup_batch1": t[0]["latency_ms"] / ti["latency_ms"],
        }
    return out


def landed(metrics: dict[str, Any], tol: float) -> dict[str, Any]:
    """Where a finished search landed by itself, and what calibration changed."""
    target = metrics.get("target_flops")
    cal = metrics.get("calibration")
    own = cal["ratio_before"] if cal else metrics["flops_ratio"]
    out = {
        "target_flops": target,
        "tolerance": tol,
        "flops_ratio": metrics["flops_ratio"],
        "landed_ratio_by_itself": own,
        "calibrated": bool(metrics.get("calibrated")),
        "calibration": cal,
    }
    if target:
        out.update(
            within_tolerance=abs(metrics["flops_ratio"] / target - 1) <= tol,
            landed_within_tolerance_by_itself=abs(own / target - 1) <= tol,
            calibration_moved_ratio_by=None if not cal else metrics["flops_ratio"] - own,
        )
    return out


def qk_dims(model: torch.nn.Module) -> list[int | None]:
    """Each block's materialized Q/K width per head (the heads are zero-padded to the largest count)."""
    return [getattr(b.attn, "qk_dim", None) for b in model.blocks]


def top1_se(acc: float, n: int) -> float:
    """Binomial standard error of a top-1 (in points) measured on ``n`` images."""
    p = acc / 100
    return 100 * math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


# ---------------------------------------------------------------------------------------------
# The uniform-pruning comparison


def compare_uniform(
    args,
    *,
    dense,
    arch,
    spec,
    x1,
    dense_flops,
    dense_rec: dict,
    mat_dir: Path,
    test_data: DataConfig,
    base_data: DataConfig,
) -> dict[str, Any]:
    compact = nascompress.load(mat_dir).eval()
    dcs_flops = count_flops(compact, x1)
    ratio = dcs_flops.total / dense_flops.total
    uni_dir = Path(args.uniform)
    uni_model, uni_record = uniform_at_flops(dense, ratio, x1)  # the library's uniform pruning at the DCS FLOPs
    uni_config = {
        "data": dataclasses.asdict(base_data),
        "uniform": {**uni_record["config"], "target_flops_ratio": ratio},
    }
    write_run(uni_dir, uni_model.eval(), dict(copy.deepcopy(arch), methods=[uni_record]), config=uni_config, force=True)
    uni_info = uniform_summary(uni_record)
    uni = nascompress.load(uni_dir).eval()
    uni_flops = count_flops(uni, x1)
    rt_data = replace(test_data, train_limit=args.retrain_limit, subset_seed=args.seed)
    lr = args.retrain_lr
    tc = TrainConfig(
        epochs=args.retrain_epochs,
        batch_size=args.retrain_batch_size,
        lr=lr,
        warmup_epochs=0.2,
        seed=args.seed,
        device=args.device,
        min_lr=min(1e-6, lr),
    )
    rc = RetrainConfig(eta=0.0, cluster_samples=args.cluster_samples)
    rows: dict[str, Any] = {}
    models, labels = [dense], ["dense"]
    for name, src, rep in (("dcs", mat_dir, dcs_flops), ("uniform", uni_dir, uni_flops)):
        before = evaluate_run(src, data=test_data, device="cpu")
        out = Path(args.retrain_runs) / f"retrained_{name}"
        t0 = time.perf_counter()
        m = retrain(
            RetrainJob(
                model_dir=str(src),
                out=str(out),
                data=rt_data,
                train=tc,
                retrain=rc,
                teacher=args.teacher,
                auto_batch=False,
            ),
            force=True,
        )
        wall = time.perf_counter() - t0
        after = evaluate_run(out, data=test_data, device="cpu")
        model = nascompress.load(out).eval()
        models.append(model)
        labels.append(name)
        rows[name] = {
            "source": str(src),
            "retrained": str(out),
            "macs": rep.total,
            "params": rep.params,
            "flops_ratio_vs_dense": rep.total / dense_flops.total,
            "params_ratio_vs_dense": rep.params / dense_flops.params,
            "test_top1_before_retraining": before.top1,
            "test_top1": after.top1,
            "test_n": after.n,
            "test_top1_se": top1_se(after.top1, after.n),
            "test_top1_minus_dense": after.top1 - dense_rec["test_top1"],
            "retrain": {
                "best_val_top1": m.best_val_top1,
                "best_epoch": m.best_epoch,
                "start_val_top1": m.start_val_top1,
                "train_time_s": m.train_time_s,
                "wall_s": wall,
                "epoch_time_s_mean": m.epoch_time_s_mean,
            },
        }
        print(name, json.dumps(rows[name]), flush=True)
    sp = speed(models, labels, (spec.in_chans, *spec.img_size), args.iters)
    for name in ("dcs", "uniform"):
        rows[name].update(sp[name])
    diff = rows["dcs"]["test_top1"] - rows["uniform"]["test_top1"]
    se = math.hypot(rows["dcs"]["test_top1_se"], rows["uniform"]["test_top1_se"])
    winner = "dcs" if diff > 0 else "uniform" if diff < 0 else "tie"
    return {
        "target_flops_ratio": ratio,
        "uniform": dict(uni_info, dir=str(uni_dir)),
        "budget": {
            "epochs": args.retrain_epochs,
            "train_limit": args.retrain_limit,
            "seed": args.seed,
            "lr": lr,
            "batch_size": args.retrain_batch_size,
            "warmup_epochs": 0.2,
            "eta": 0.0,
            "cluster_samples": args.cluster_samples,
            "teacher": args.teacher,
            "data": data_sizes(load_data(rt_data, spec=spec), rt_data),
        },
        "rows": rows,
        "speed": sp,
        "winner_by_test_top1": winner,
        "test_top1_dcs_minus_uniform": diff,
        "difference_se_unpaired": se,
        "difference_over_se": diff / se if se else None,
        "note": "same FLOPs target (the DCS-materialized model's ratio), same retraining budget; top-1 on the "
        "same test images; throughput ratios of the retrained models vs dense measured interleaved "
        "in one process (batch 64), latency at batch 1",
    }


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--search", default="runs/dcs_search")
    ap.add_argument("--mat", default="runs/dcs_mat")
    ap.add_argument("--out", default="bench/results/dcs.json")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=None, help="search batch (default: the search's, 128)")
    ap.add_argument("--train-limit", type=int, default=24000)
    ap.add_argument(
        "--eval-limit",
        type=int,
        default=None,
        help="val/test images for the search and every test top-1 here (default: all; dry runs only)",
    )
    ap.add_argument("--target-flops", type=float, default=0.6)
    ap.add_argument("--arch-lr", type=float, default=None, help="default: the search's (sized from the budget)")
    ap.add_argument("--qk-mask", default="static")
    ap.add_argument("--round-mlp", type=int, default=32, help="Close MLPs with < K channels (0: the paper as is).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="device of the search and the retraining (speed: always CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument(
        "--paper-search",
        default=None,
        help="The same search without --round-mlp: reused if finished there, else run there.",
    )
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--step-rounds", type=int, default=6, help="Rounds of 10+10 interleaved training steps (0: skip).")
    ap.add_argument("--skip-search", action="store_true", help="Reuse an existing finished --search.")
    ap.add_argument("--skip-epoch-time", action="store_true", help="Do not time a dense epoch.")
    ap.add_argument("--also-input", action="store_true", help="Also measure the input-dependent Q/K variant.")
    ap.add_argument(
        "--compare-uniform",
        action="store_true",
        help="Uniform pruning at the DCS model's FLOPs; both retrained with the same budget.",
    )
    ap.add_argument("--uniform", default="runs/uniform", help="run directory of the uniformly pruned model")
    ap.add_argument("--retrain-runs", default="runs/bench_dcs_retrain", help="where the two retrained runs go")
    ap.add_argument("--retrain-epochs", type=int, default=4)
    ap.add_argument("--retrain-limit", type=int, default=30000, help="training images of each retraining")
    ap.add_argument("--retrain-lr", type=float, default=3e-4, help="absolute peak lr (nascompress retrain's default)")
    ap.add_argument("--retrain-batch-size", type=int, default=128)
    ap.add_argument("--cluster-samples", type=int, default=None, help="IB clusters (eta = 0: only logged)")
    ap.add_argument("--teacher", default=None, help="optional KD teacher run for both retrainings")
    ap.add_argument("--wait-s", type=float, default=3600)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base, search_dir, mat_dir = Path(args.base), Path(args.search), Path(args.mat)
    wait_for_base(base, args.wait_s)
    res: dict[str, Any] = {**header(), "status": "partial"}

    def checkpoint() -> None:
        save(args.out, res)

    # Dense reference (every test top-1 below on the same test images).
    dense, arch = load_with_arch(base)
    dense.eval()
    spec = InputSpec.from_dict(arch["input"])
    x1 = torch.zeros(1, spec.in_chans, *spec.img_size)
    shape = (spec.in_chans, *spec.img_size)
    dense_flops = count_flops(dense, x1)
    base_data = run_data_config(base) or DataConfig()
    test_data = replace(base_data, eval_limit=args.eval_limit)
    dense_test = evaluate_run(base, data=test_data, device="cpu")
    res["dense"] = {
        "dir": str(base),
        "macs": dense_flops.total,
        "params": dense_flops.params,
        "test_top1": dense_test.top1,
        "test_n": dense_test.n,
        "file_bytes": (base / "model.safetensors").stat().st_size,
    }
    res["test_data"] = data_sizes(load_data(test_data, spec=spec), test_data)

    # Search (static Q/K so the masks can be removed physically), then materialize.
    data_cfg = replace(base_data, train_limit=args.train_limit, eval_limit=args.eval_limit, subset_seed=args.seed)
    search_cfg = DCSSearchConfig(
        target_flops=args.target_flops, arch_lr=args.arch_lr, round_mlp=args.round_mlp, auto_batch=False
    )
    train_cfg = search_train_config(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, device=args.device)
    job = DCSSearchJob(
        source=str(base),
        out=str(search_dir),
        method=DCSConfig(qk_mask=args.qk_mask),
        search=search_cfg,
        train=train_cfg,
        data=data_cfg,
    )
    if not args.skip_search:
        search_dcs(job, force=True)
    search_metrics = read_json(search_dir / "metrics.json")
    log = [json.loads(ln) for ln in (search_dir / "log.jsonl").read_text().splitlines() if ln]
    search_data = load_data(data_cfg, spec=spec)
    sup_test = evaluate_run(search_dir, data=test_data, device="cpu")
    res["search"] = {
        "dir": str(search_dir),
        "job": job.to_dict(),
        "data": data_sizes(search_data, data_cfg),
        **landed(search_metrics, search_cfg.tolerance),
        "final_lambda": search_metrics["lam"],
        "expected_flops_ratio": log[-1].get("expected_flops_ratio"),
        "dense_val_top1": search_metrics.get("dense_val_top1"),
        "val_top1": search_metrics["val_top1"],
        "supernet_test_top1": sup_test.top1,
        "epoch_time_s": search_metrics["epoch_time_s"],
        "search_time_s": search_metrics["search_time_s"],
        "mlp_kept": search_metrics["mlp_kept"],
        "qk_kept": search_metrics.get("qk_kept"),
        "log": log,
    }
    print(
        "search",
        json.dumps(
            {k: res["search"][k] for k in ("flops_ratio", "landed_ratio_by_itself", "calibrated", "supernet_test_top1")}
        ),
        flush=True,
    )
    checkpoint()

    mat_metrics = materialize_search(MaterializeJob(search_dir=str(search_dir), out=str(mat_dir)), force=True)
    compact = nascompress.load(mat_dir).eval()
    mat_test = evaluate_run(mat_dir, data=test_data, device="cpu")
    flops = count_flops(compact, x1)
    res["materialized"] = {
        "dir": str(mat_dir),
        "macs": flops.total,
        "params": flops.params,
        "test_top1_before_retraining": mat_test.top1,
        "test_n": mat_test.n,
        "file_bytes": (mat_dir / "model.safetensors").stat().st_size,
        "max_abs_logit_diff_vs_supernet": mat_metrics.max_abs_logit_diff,
        "mlp_kept": mat_metrics.mlp_kept,
        "qk_kept_per_head": mat_metrics.qk_kept,
        "qk_dim_padded": qk_dims(compact),
        "mlp_width": [blk.mlp.fc1.in_features if hasattr(blk.mlp, "fc1") else 0 for blk in dense.blocks],
        "flops_ratio_vs_dense": flops.total / dense_flops.total,
        "flops_ratio_dense_over_compact": dense_flops.total / flops.total,
        "params_ratio": dense_flops.params / flops.params,
    }

    # Throughput, interleaved in this process; the claim: speedup >= 0.8 x FLOPs ratio.
    sp = speed([dense, compact], ["dense", "compact"], shape, args.iters)
    fr = dense_flops.total / flops.total
    sp.update(sp.pop("compact"), flops_ratio=fr, required_speedup=0.8 * fr)
    sp["passes"] = sp["throughput_speedup_batch64"] >= 0.8 * fr
    res["speed"] = sp
    print(
        "speed",
        json.dumps({k: sp[k] for k in ("throughput_speedup_batch64", "latency_speedup_batch1", "flops_ratio")}),
        flush=True,
    )
    checkpoint()

    if args.compare_uniform:
        res["uniform_comparison"] = compare_uniform(
            args,
            dense=dense,
            arch=arch,
            spec=spec,
            x1=x1,
            dense_flops=dense_flops,
            dense_rec=res["dense"],
            mat_dir=mat_dir,
            test_data=test_data,
            base_data=base_data,
        )
        uc = res["uniform_comparison"]
        print(
            "uniform comparison",
            json.dumps(
                {k: uc[k] for k in ("target_flops_ratio", "winner_by_test_top1", "test_top1_dcs_minus_uniform")}
            ),
            flush=True,
        )
        checkpoint()

    if args.paper_search:  # the same search without block rounding: channels spread over the blocks
        pdir = Path(args.paper_search)
        pm_path = pdir / "metrics.json"
        ran = not (pm_path.is_file() and read_json(pm_path).get("finished"))
        if ran:
            search_dcs(job.replace(out=str(pdir), search=search_cfg.replace(round_mlp=0)), force=True)
        p_metrics = read_json(pm_path)
        with tempfile.TemporaryDirectory() as tmp:
            pm = materialize_search(MaterializeJob(search_dir=str(pdir), out=str(Path(tmp) / "m")), force=True)
            p_model = nascompress.load(Path(tmp) / "m").eval()
        sp_p = speed([dense, p_model], ["dense", "compact"], shape, args.iters)["compact"]
        fr_p = dense_flops.total / pm.macs
        res["without_round_mlp"] = {
            "search_dir": str(pdir),
            "ran_here": ran,
            "mlp_kept": pm.mlp_kept,
            "qk_kept_per_head": pm.qk_kept,
            "macs": pm.macs,
            "params": pm.params,
            "flops_ratio": fr_p,
            "flops_ratio_vs_dense": 1 / fr_p,
            "supernet_test_top1": evaluate_run(pdir, data=test_data, device="cpu").top1,
            **sp_p,
            "required_speedup": 0.8 * fr_p,
            **{f"search_{k}": v for k, v in landed(p_metrics, search_cfg.tolerance).items()},
        }
        checkpoint()

    if args.also_input:  # the paper's input-dependent Q/K mask, same MLP selection: runtime mask kept
        sup, _ = load_with_arch(search_dir)
        cfg_in = DCSConfig(qk_mask="input")
        sup_in = make_supernet(copy.deepcopy(dense), cfg_in).eval()
        with torch.no_grad():
            for b_in, b in zip(sup_in.blocks, sup.blocks):
                b_in.dcs_alpha.copy_(b.dcs_alpha)
        m_in, _ = materialize(sup_in, cfg_in)
        f_in = count_flops(m_in, x1)
        sp_in = speed([dense, m_in], ["dense", "compact"], shape, args.iters)["compact"]
        res["input_dependent_variant_same_mlp"] = {
            "macs": f_in.total,
            "params": f_in.params,
            "flops_ratio": dense_flops.total / f_in.total,
            "flops_ratio_vs_dense": f_in.total / dense_flops.total,
            **sp_in,
            "note": "theta Linear kept at run time (counted); untrained theta, speed/FLOPs only",
        }
        checkpoint()

    # Search epoch vs dense training epoch on the same images.
    ep: dict[str, Any] = {"images": search_metrics["train_images"]}
    t_search = sorted(search_metrics["epoch_time_s"])[len(search_metrics["epoch_time_s"]) // 2]
    ep["search_epoch_s_median"] = t_search
    if not args.skip_epoch_time:
        d = dense_epoch_time(dense, arch, spec, data_cfg, train_cfg)
        ep.update(d, ratio_of_epochs=t_search / d["dense_epoch_s"])
    if args.step_rounds > 0:
        ep["interleaved_steps"] = interleaved_step_ratio(job, dense, arch, spec, search_data, rounds=args.step_rounds)
    res["search_epoch_vs_dense_epoch"] = ep
    res["status"] = "ok"
    checkpoint()
    summary = {k: res[k] for k in ("dense", "materialized", "speed", "search_epoch_vs_dense_epoch")}
    summary["search"] = {
        k: res["search"][k] for k in ("flops_ratio", "landed_ratio_by_itself", "calibrated", "calibration")
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(main())
