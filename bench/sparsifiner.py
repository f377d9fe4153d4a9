"""Sparsifiner benchmark: block-sparse attention vs dense SDPA, and Fashion-MNIST accuracy/FLOPs.

Part 1 (``--part speed``): one attention call at 197, 785 and 3137 tokens (batch 1, 6 heads,
head dim 64, keep ratio 0.25). ``gather`` is the module's inference path
(``block_sparse.block_sparse_attention``) and INCLUDES the predictor (W_down K, A_down, thresholds,
pooled tile scores, top blocks), the gathering of the kept key blocks and the dense CLS row;
``flex`` is the same with compiled FlexAttention on a BlockMask built from the block indices;
dense is fused ``F.scaled_dot_product_attention`` on the same q/k/v. Interleaved medians
(``time_models``), one process. ``--threads`` sets torch's thread count.

Part 2 (``--part fmnist``): from the dense base run (runs/base, 50 tokens): test top-1 and FLOPs
zero-shot and after a short fine-tune (seeded class-stratified subsets, see JSON), two keep ratios,
unstructured vs block. Zero-shot is the region-initialised predictor without any training, and
(``zero_shot_calibrated_unstructured``) after the library's predictor-only stage (what
``nascompress finetune --zero-shot`` does: recipe ``stage1_steps``). ``--part control``: the same
fine-tune at keep ratio 1 (dense attention).

    python bench/sparsifiner.py --part speed --threads 2
    python bench/sparsifiner.py --part speed --threads 1
    python bench/sparsifiner.py --part fmnist --base runs/base

Each part is merged into bench/results/sparsifiner.json (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from _common import ROOT, data_sizes, header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nascompress  # noqa: E402,F401
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data, preprocess  # noqa: E402
from nascompress.profiling.evaluate import evaluate  # noqa: E402
from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.methods import block_sparse, get_method  # noqa: E402
from nascompress.methods.sparsifiner import SparsifinerRecipe
from nascompress.methods.sparsifiner_kernel import region_init, sparse_modules  # noqa: E402
from nascompress.profiling import count_flops, time_models  # noqa: E402

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
        scale = d**-0.5
        budget = math.ceil(keep_ratio * n)
        layout = block_sparse.plan_blocks(n, 1, budget)
        basis = block_sparse.pooled_basis(w_up, 1e-2, layout)  # weights only: the module caches it

        def dense(_):
            return F.scaled_dot_product_attention(q, k, v)

        def path(kernel):
            def run(_):  # the module's inference path: block predictor + kept blocks + attention
                return block_sparse.block_sparse_attention(
                    q, k, v, w_down, basis, layout, scale=scale, tau=0.05, kernel=kernel
                )[0]

            return run

        def predictor(_):
            return block_sparse.predict_blocks(q, k, w_down, basis, scale=scale, tau=0.05, layout=layout)

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
        row = {
            "tokens": n,
            "budget": budget,
            "compile_s": compile_s,
            "dense_ms": times[0] * 1e3,
            # False: the library refused the compiled kernel for this layout, so "flex" timed the gather path
            "flex_kernel_used": block_sparse.flex_kernel_ok(layout, q),
            "layout": {
                "block_size": layout.bs,
                "blocks": layout.nb,
                "kept_blocks": layout.keep,
                "keys_per_query": layout.prefix + layout.keep * layout.bs,
                "kept_pair_fraction": block_sparse.kept_pairs(idx, layout).sum().item() / (H * n * n),
            },
        }
        for name, t in zip(names[1:], times[1:]):
            row[name] = {"ms": t * 1e3, "speedup_vs_dense": times[0] / t}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _set_mode(model, **changes) -> None:
    for m in sparse_modules(model):
        m.cfg = m.cfg.replace(**changes)


def _measure(model, data, spec, xb) -> dict:
    model.eval()
    res = evaluate(model, data.test, input_spec=spec, device=torch.device("cpu"), batch_size=500)
    rep = count_flops(model, xb)  # the last forward: the kernels' densities below are on xb
    mods = sparse_modules(model)
    dens = [m.density for m in mods]
    attn_mm = sum(b["attn"] for b in rep.blocks)
    return {
        "test_top1": res.top1,
        "test_n": res.n,
        "gflops": rep.gflops,
        "mflops": rep.total / 1e6,
        "attn_bucket_mflops": attn_mm / 1e6,
        "mean_kept_key_fraction": sum(dens) / len(dens) if dens else 1.0,
    }


def _data_config(base: Path, train_limit: int, eval_limit: int, seed: int) -> DataConfig:
    return replace(
        run_data_config(base) or DataConfig(), train_limit=train_limit, eval_limit=eval_limit, subset_seed=seed
    )


def _train_config(epochs: int, seed: int):
    return finetune_train_config(
        "sparsifiner", epochs=epochs, batch_size=128, lr=1e-4, min_lr=1e-6, warmup_epochs=0.0, seed=seed, device="cpu"
    )


def fmnist(
    base: Path,
    runs: Path,
    keep_ratios=(0.5, 0.25),
    n_down=8,
    train_limit=6000,
    eval_limit=2000,
    epochs=2,
    stage1_epochs=1,
    seed=0,
) -> dict:
    dense, arch = load_with_arch(base)
    log = base / "log.jsonl"
    epochs_done = (
        sum(1 for ln in log.read_text().splitlines() if ln and not json.loads(ln).get("start"))
        if log.is_file()
        else None
    )
    spec = InputSpec.from_dict(arch["input"])
    data_cfg = _data_config(base, train_limit, eval_limit, seed)
    data = load_data(data_cfg, spec=spec)
    n_x = min(64, len(data.test))
    imgs = torch.stack([data.test[i][0] for i in range(n_x)])
    xb = preprocess(imgs, spec)
    method = get_method("sparsifiner")
    stage1_steps = SparsifinerRecipe().stage1_steps
    out = {
        "base": str(base),
        "base_finished": (base / "metrics.json").is_file(),
        "base_epochs_done": epochs_done,
        "data": data_sizes(data, data_cfg),
        "seed": seed,
        "setup": f"test subset {len(data.test)} images (seeded, class-stratified); fine-tune on {len(data.train)} "
        f"train images, {epochs} epochs ({stage1_epochs} stage-1 epoch: predictor only, L_attn; then "
        "stage 2: CE + 0.5 L_token + 0.5 KL), lr 1e-4, predictor lr x10, batch 128; "
        f"n_down={n_down} (the base has {int(dense.patch_embed.num_patches) + int(dense.num_prefix_tokens)}"
        " tokens); block mode: block_size auto (divisor of the patch count near 1/8 of it) and 4 "
        "(block4); CLS rows and CLS keys dense; evaluated on the masked path, which the tests show equal "
        f"to the gather and FlexAttention paths; FLOPs per image on {n_x} test images; zero_shot_*: the "
        "region-initialised predictor, no training; zero_shot_calibrated_unstructured: after the "
        f"predictor-only stage of `finetune --zero-shot` ({stage1_steps} steps, batch 128); "
        "finetuned_block*: the unstructured fine-tune evaluated with block masks; "
        "finetuned_in_block_mode: fine-tuned with the block mask (auto block size)",
        "dense": _measure(dense, data, spec, xb),
        "rows": [],
    }
    print(json.dumps(out["dense"]), flush=True)

    def tune(name: str, mcfg: dict, row: dict, *, zero_shot: bool = False):
        t0 = time.perf_counter()
        m = finetune(
            FinetuneJob(
                run_dir=str(base),
                method="sparsifiner",
                config=mcfg,
                recipe={"stage1_epochs": stage1_epochs},
                data=data_cfg,
                train=_train_config(epochs, seed),
                out=str(runs / name),
                zero_shot=zero_shot,
            ),
            force=True,
        )
        row["zero_shot_calibration_s" if zero_shot else f"finetune_{name.split('_', 1)[1]}_s"] = (
            time.perf_counter() - t0
        )
        return load_with_arch(runs / name)[0], m

    for kr in keep_ratios:
        cfg = {"attn_keep_ratio": kr, "n_down": n_down}
        row: dict = {"attn_keep_ratio": kr, "n_down": n_down}
        zs, _ = method.prepare_fresh(copy.deepcopy(dense), cfg)
        row["zero_shot_unstructured"] = _measure(zs, data, spec, xb)
        _set_mode(zs, mode="block", kernel="masked")
        row["zero_shot_block"] = _measure(zs, data, spec, xb)
        _set_mode(zs, block_size=4)
        row["zero_shot_block4"] = _measure(zs, data, spec, xb)
        zc, zm = tune(f"keep{kr}_zeroshot", cfg, row, zero_shot=True)
        row["zero_shot_calibrated_unstructured"] = dict(
            _measure(zc, data, spec, xb), calibration=zm.get("calibration"), stage1_steps=stage1_steps
        )
        ft, fm = tune(f"keep{kr}_unstructured", cfg, row)
        row["finetuned_unstructured"] = dict(
            _measure(ft, data, spec, xb), best_epoch=fm.best_epoch, start_val_top1=fm.start_val_top1
        )
        _set_mode(ft, mode="block", kernel="masked")
        row["finetuned_block"] = _measure(ft, data, spec, xb)
        _set_mode(ft, block_size=4)
        row["finetuned_block4"] = _measure(ft, data, spec, xb)
        # each mask trained in its own mode: stage 2 fine-tunes the backbone under the block mask
        ftb, fbm = tune(f"keep{kr}_block", dict(cfg, mode="block"), row)
        row["finetuned_in_block_mode"] = dict(
            _measure(ftb, data, spec, xb), best_epoch=fbm.best_epoch, start_val_top1=fbm.start_val_top1
        )
        row["finetuned_in_block_mode_minus_unstructured_top1"] = (
            row["finetuned_in_block_mode"]["test_top1"] - row["finetuned_unstructured"]["test_top1"]
        )
        for k in ("zero_shot", "finetuned"):
            for b in ("block", "block4"):
                row[f"{k}_{b}_minus_unstructured_top1"] = (
                    row[f"{k}_{b}"]["test_top1"] - row[f"{k}_unstructured"]["test_top1"]
                )
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    ref, _ = method.prepare_fresh(copy.deepcopy(dense), {"attn_keep_ratio": 0.5})
    out["zero_shot_n_down32_keep0.5"] = _measure(ref, data, spec, xb)
    return out


def control(base: Path, runs: Path, train_limit=6000, eval_limit=2000, epochs=2, stage1_epochs=1, seed=0) -> dict:
    """The same fine-tune with keep ratio 1 (dense attention): separates the effect of more training
    of a not fully trained base from the effect of sparsification."""
    t0 = time.perf_counter()
    m = finetune(
        FinetuneJob(
            run_dir=str(base),
            method="sparsifiner",
            config={"attn_keep_ratio": 1.0, "n_down": 8},
            recipe={"stage1_epochs": stage1_epochs},
            data=_data_config(base, train_limit, eval_limit, seed),
            train=_train_config(epochs, seed),
            out=str(runs / "keep1.0"),
        ),
        force=True,
    )
    return {
        "attn_keep_ratio": 1.0,
        "test_top1": m.test_top1,
        "test_n": m.test_n,
        "best_epoch": m.best_epoch,
        "finetune_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["all", "speed", "fmnist", "control"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--base", default="runs/base", help="dense run (a snapshot of it while it is still training)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--runs", default=os.environ.get("SP_BENCH_RUNS", "runs/sp_bench"), help="where the fine-tuned runs go"
    )
    ap.add_argument("--tokens", default="197,785,3137", help="speed: token counts")
    ap.add_argument("--iters", type=int, default=21, help="speed: interleaved rounds")
    ap.add_argument("--keep-ratios", default="0.5,0.25", help="fmnist: keep ratios")
    ap.add_argument("--n-down", type=int, default=8)
    ap.add_argument("--train-limit", type=int, default=6000)
    ap.add_argument("--eval-limit", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--stage1-epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="fine-tune seed and the seed of the data subsets")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out_path, runs = Path(args.out), Path(args.runs)
    base = Path(args.base) if Path(args.base).is_absolute() else ROOT / args.base
    h = header()

    def save_part(key: str, sub: str | None, value) -> None:
        # re-read before writing: several parts may run at once in separate processes
        res = json.loads(out_path.read_text()) if out_path.exists() else {}
        value = dict(value, command=h["command"], machine=h["machine"]) if isinstance(value, dict) else value
        if sub is None:
            old = res.get(key) if isinstance(res.get(key), dict) else {}
            keep = {k: v for k, v in old.items() if k == "dense_finetune_control"}  # another part's entry
            res[key] = {**keep, **value}
        else:
            res.setdefault(key, {})[sub] = value
        save(out_path, res)

    if args.part in ("all", "speed"):
        tokens = tuple(int(t) for t in args.tokens.split(","))
        save_part(
            "speed",
            f"threads_{args.threads}",
            {
                "setup": "batch 1, 6 heads, head dim 64, keep ratio 0.25, n_down 32, tau 0.05, q/k/v strided views "
                "of one qkv tensor; sparse times include the predictor (W_down K, A_down, thresholds, tile "
                "scores, top blocks), the gathering of kept blocks (gather) or the BlockMask (flex) and the "
                "dense CLS row; the pooled W_up (weights only) is cached as in the module; medians of "
                f"{args.iters} interleaved rounds, torch threads={args.threads}; machine load average at start "
                f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
                "rows": speed(tokens=tokens, iters=args.iters),
            },
        )
    kw = dict(
        train_limit=args.train_limit,
        eval_limit=args.eval_limit,
        epochs=args.epochs,
        stage1_epochs=args.stage1_epochs,
        seed=args.seed,
    )
    if args.part in ("all", "fmnist"):
        save_part(
            "fmnist",
            None,
            fmnist(
                base, runs, keep_ratios=tuple(float(k) for k in args.keep_ratios.split(",")), n_down=args.n_down, **kw
            ),
        )
    if args.part in ("all", "control"):
        save_part("fmnist", "dense_finetune_control", control(base, runs, **kw))


if __name__ == "__main__":
    main()
