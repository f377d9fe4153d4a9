"""Sparsifiner benchmark: block-sparse attention vs dense SDPA, and Fashion-MNIST accuracy/FLOPs.

Part 1 (``--part speed``): one attention call at 197, 785 and 3137 tokens (batch 1, 6 heads,
head dim 64, keep ratio 0.25). ``gather`` is the module's inference path
(``_flex.block_sparse_attention``) and INCLUDES the predictor (W_down K, A_down, thresholds,
pooled tile scores, top blocks), the gathering of the kept key blocks and the dense CLS row;
``flex`` is the same with compiled FlexAttention on a BlockMask built from the block indices;
dense is fused ``F.scaled_dot_product_attention`` on the same q/k/v. Interleaved medians
(``time_models``), one process. ``--threads`` sets torch's thread count.

Part 2 (``--part fmnist``): from the dense base run (runs/base, 50 tokens): test top-1 and FLOPs
zero-shot and after a short fine-tune (subset, see JSON), two keep ratios, unstructured vs block.

    python bench/sparsifiner.py --part all   # writes bench/results/sparsifiner.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nascompress  # noqa: F401
from nascompress.methods import _flex
from nascompress.methods.sparsifiner import (region_init,
                                             sparse_modules)
from nascompress.profiling.latency import time_models

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "sparsifiner.json"


def speed(tokens=(197, 785, 3137), keep_ratio=0.25, iters=21) -> list[dict]:
    """One attention call per path, batch 1, 6 heads, head dim 64: q, k, v are the strided views of
    a qkv projection output (what timm's Attention hands to SDPA), the same tensors for every path."""
    torch.manual_seed(0)
    H, d, r = 6, 64, 32
    rows = []
    for n in tokens:
        qkv = torch.randn(1, n, 3, H, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        side = math.isqrt(n - 1)
        wd, wu = region_init(n, r, prefix=1, grid=(side, side))
        w_down, w_up = wd.expand(H, -1, -1).contiguous(), wu.expand(H, -1, -1).contiguous()
        scale = d ** -0.5
        budget = math.ceil(keep_ratio * n)
        layout = _flex.plan_blocks(n, 1, budget)
        basis = _flex.pooled_basis(w_up, 1e-2, layout)  # weights only: the module caches it

        def dense(_):
            return F.scaled_dot_product_attention(q, k, v)

        def path(kernel):
            def run(_):  # the module's inference path: block predictor + kept blocks + attention
                return _flex.block_sparse_attention(q, k, v, w_down, basis, layout, scale=scale, tau=0.05,
                                                    kernel=kernel)[0]
            return run

        def predictor(_):
            return _flex.predict_blocks(q, k, w_down, basis, scale=scale, tau=0.05, layout=layout)

        fns = [dense, path("gather"), path("flex"), predictor]
        names = ["dense_sdpa", "gather", "flex", "predictor_only"]
        t0 = time.perf_counter()
        with torch.inference_mode():
            for f in fns[1:]:
                f(None)  # compile the flex kernel outside the timing
        compile_s = time.perf_counter() - t0
        times = time_models(fns, q, warmup=3, iters=iters)
        with torch.inference_mode():
            idx = predictor(None)
        row = {"tokens": n, "budget": budget, "compile_s": compile_s, "dense_ms": times[0] * 1e3,
               "layout": {"block_size": layout.bs, "blocks": layout.nb, "kept_blocks": layout.keep,
                          "keys_per_query": layout.prefix + layout.keep * layout.bs,
                          "kept_pair_fraction": _flex.kept_pairs(idx, layout).sum().item() / (H * n * n)}}
        for name, t in zip(names[1:], times[1:]):
            row[name] = {"ms": t * 1e3, "speedup_vs_dense": times[0] / t}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _set_mode(model, **changes) -> None:
    for m in sparse_modules(model):
        m.sp_cfg = type(m.sp_cfg)(**dict(m.sp_cfg.to_dict(), **changes))


def _measure(model, data, spec, xb) -> dict:
    from nascompress.evaluate import evaluate
    from nascompress.profiling import count_flops

    model.eval()
    res = evaluate(model, data.test, input_spec=spec, device=torch.device("cpu"), batch_size=500)
    rep = count_flops(model, xb)
    mods = sparse_modules(model)
    dens = [getattr(m, "sp_density", 1.0) for m in mods]
    attn_mm = sum(b["attn"] for b in rep.blocks)
    return {"test_top1": res["top1"], "gflops": rep.gflops, "mflops": rep.total / 1e6,
            "attn_bucket_mflops": attn_mm / 1e6, "mean_kept_key_fraction": sum(dens) / len(dens) if dens else 1.0}


def fmnist(base="runs/base", keep_ratios=(0.5, 0.25), n_down=8, train_limit=6000, eval_limit=2000,
           epochs=2, stage1_epochs=1) -> dict:
    import copy

    from nascompress.data import DataConfig, InputSpec, load_data, preprocess
    from nascompress.finetune import FinetuneJob, finetune
    from nascompress.io import load_with_arch
    from nascompress.methods import get_method
    from nascompress.train import TrainConfig

    base = ROOT / base
    dense, arch = load_with_arch(base)
    log = base / "log.jsonl"
    epochs_done = len(log.read_text().splitlines()) if log.is_file() else None
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(DataConfig(train_limit=train_limit, eval_limit=eval_limit), img_size=spec.img_size)
    imgs = torch.stack([data.test[i][0] for i in range(64)])
    xb = preprocess(imgs, spec)
    out = {"base": str(base), "base_finished": (base / "metrics.json").is_file(), "base_epochs_done": epochs_done,
           "setup": f"test subset {eval_limit} images; fine-tune on {train_limit} train images, {epochs} epochs "
                    f"({stage1_epochs} stage-1 epoch: predictor only, L_attn; then stage 2: CE + 0.5 L_token + 0.5 "
                    f"KL), lr 1e-4, predictor lr x10, batch 128; n_down={n_down} (the base has 50 tokens); "
                    "block mode: block_size auto (49 patch tokens -> 7 blocks of 7, one grid row each) and 4 "
                    "(block4: 13 blocks, the last 1 token); CLS rows and CLS keys dense; "
                    "evaluated on the masked path, which the tests show equal to the gather and FlexAttention paths; "
                    "FLOPs per image on 64 test images; finetuned_block*: the unstructured fine-tune evaluated with "
                    "block masks; finetuned_in_block_mode: fine-tuned with the block mask (auto block size)",
           "dense": _measure(dense, data, spec, xb), "rows": []}
    print(json.dumps(out["dense"]), flush=True)
    for kr in keep_ratios:
        cfg = {"attn_keep_ratio": kr, "n_down": n_down}
        row = {"attn_keep_ratio": kr, "n_down": n_down}
        zs = get_method("sparsifiner")(copy.deepcopy(dense), {"name": "sparsifiner", "config": cfg})
        row["zero_shot_unstructured"] = _measure(zs, data, spec, xb)
        _set_mode(zs, mode="block", kernel="masked")
        row["zero_shot_block"] = _measure(zs, data, spec, xb)
        _set_mode(zs, block_size=4)
        row["zero_shot_block4"] = _measure(zs, data, spec, xb)
        runs = Path(os.environ.get("SP_BENCH_RUNS", "/tmp/sp_bench"))

        def tune(name: str, mcfg: dict):
            t0 = time.perf_counter()
            finetune(FinetuneJob(run_dir=str(base), method="sparsifiner",
                                 method_config=dict(mcfg, stage1_epochs=stage1_epochs),
                                 data=DataConfig(train_limit=train_limit, eval_limit=eval_limit),
                                 train=TrainConfig(epochs=epochs, batch_size=128, lr=1e-4, min_lr=1e-6,
                                                   warmup_epochs=0.0),
                                 out=str(runs / name)), force=True)
            row[f"finetune_{name.split('_', 1)[1]}_s"] = time.perf_counter() - t0
            return load_with_arch(runs / name)[0]

        ft = tune(f"keep{kr}_unstructured", cfg)
        row["finetuned_unstructured"] = _measure(ft, data, spec, xb)
        _set_mode(ft, mode="block", kernel="masked")
        row["finetuned_block"] = _measure(ft, data, spec, xb)
        _set_mode(ft, block_size=4)
        row["finetuned_block4"] = _measure(ft, data, spec, xb)
        # each mask trained in its own mode: stage 2 fine-tunes the backbone under the block mask
        ftb = tune(f"keep{kr}_block", dict(cfg, mode="block"))
        row["finetuned_in_block_mode"] = _measure(ftb, data, spec, xb)
        row["finetuned_in_block_mode_minus_unstructured_top1"] = (row["finetuned_in_block_mode"]["test_top1"]
                                                                  - row["finetuned_unstructured"]["test_top1"])
        for k in ("zero_shot", "finetuned"):
            for b in ("block", "block4"):
                row[f"{k}_{b}_minus_unstructured_top1"] = row[f"{k}_{b}"]["test_top1"] - row[f"{k}_unstructured"]["test_top1"]
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    ref = get_method("sparsifiner")(copy.deepcopy(dense), {"name": "sparsifiner", "config": {"attn_keep_ratio": 0.5}})
    out["zero_shot_n_down32_keep0.5"] = _measure(ref, data, spec, xb)
    return out


def control(base="runs/base", train_limit=6000, eval_limit=2000, epochs=2) -> dict:
    """The same fine-tune with keep ratio 1 (dense attention): separates the effect of more training
    of a not fully trained base from the effect of sparsification."""
    from nascompress.data import DataConfig
    from nascompress.finetune import FinetuneJob, finetune
    from nascompress.train import TrainConfig

    t0 = time.perf_counter()
    m = finetune(FinetuneJob(run_dir=str(ROOT / base), method="sparsifiner",
                             method_config={"attn_keep_ratio": 1.0, "n_down": 8, "stage1_epochs": 1},
                             data=DataConfig(train_limit=train_limit, eval_limit=eval_limit),
                             train=TrainConfig(epochs=epochs, batch_size=128, lr=1e-4, min_lr=1e-6, warmup_epochs=0.0),
                             out=str(Path(os.environ.get("SP_BENCH_RUNS", "/tmp/sp_bench")) / "keep1.0")), force=True)
    return {"attn_keep_ratio": 1.0, "test_top1": m["test_top1"], "finetune_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["all", "speed", "fmnist", "control"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--base", default="runs/base", help="dense run (a snapshot of it while it is still training)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def save(key: str, sub: str | None, value) -> None:
        # re-read before writing: several parts may run at once in separate processes
        res = json.loads(OUT.read_text()) if OUT.exists() else {}
        if sub is None:
            res[key] = value
        else:
            res.setdefault(key, {})[sub] = value
        OUT.write_text(json.dumps(res, indent=1))

    if args.part in ("all", "speed"):
        save("speed", f"threads_{args.threads}", {
            "setup": "batch 1, 6 heads, head dim 64, keep ratio 0.25, n_down 32, tau 0.05, q/k/v strided views "
                     "of one qkv tensor; sparse times include the predictor (W_down K, A_down, thresholds, tile "
                     "scores, top blocks), the gathering of kept blocks (gather) or the BlockMask (flex) and the "
                     "dense CLS row; the pooled W_up (weights only) is cached as in the module; medians of 21 "
                     "interleaved "
                     f"rounds, torch threads={args.threads}; machine load average at start {os.getloadavg()[0]:.1f} "
                     "on 2 cores (shared)",
            "rows": speed()})
    if args.part in ("all", "fmnist"):
        save("fmnist", None, fmnist(base=args.base))
    if args.part in ("all", "control"):
        save("fmnist", "dense_finetune_control", control(base=args.base))

if __name__ == "__main__":
    main()
