"""How close the latency table's prediction comes to measured latency (issue 65's goal: within 10% on
every shipped recipe): per recipe geometry, a latency table measured on this machine
(:func:`nascompress.profiling.latency_table`), then the dense model and pruned variants of it (MLP
hidden halved, heads removed, Q/K narrowed, blocks removed, all together) timed interleaved
(:func:`nascompress.profiling.time_models`, medians) and predicted from the table
(:func:`nascompress.profiling.predict_latency`), at batch 1 and 16, fp32 and (where the CPU has
AVX512-BF16 or AMX, or on CUDA) bf16. Random weights: latency does not depend on them.

Recipes: the main job's model (``configs/fashion-mnist.yaml``: 28 px, patch 4, width 96, depth 6, 3
heads), DeiT-S/224 and DINOv2 ViT-S/14 at 112 px (timm, random weights). Variants are sliced from the
real timm model (:func:`nascompress.models.slicing.slice_hidden`, :func:`~nascompress.models.slicing.slice_qk`;
heads: a fresh timm Attention with fewer heads of the same head dim; blocks: the first ones kept).

    python bench/latency_predictor.py                   # all: about half an hour on 2 cores
    python bench/latency_predictor.py --recipes main --batches 1 --iters 3 --table-iters 1 --out smoke.json
"""

from __future__ import annotations

import argparse
import time

from _common import header, load, save, slug  # noqa: E402  (puts the repository on sys.path)

import timm
import torch
from timm.layers import Attention
from torch import nn

import nascompress  # noqa: F401  (before timm: the torchvision fix)
from nascompress import runtime
from nascompress.models.layers import core_attention, to_core
from nascompress.models.build import build_model, custom_vit_spec
from nascompress.profiling import geometry_of, latency_table, measured_ms, predict_latency, time_models
from nascompress.profiling.latency_table import cpu_info
from nascompress.models.slicing import slice_hidden, slice_qk

RECIPES = {
    "main": "the main job's model (28 px, patch 4, width 96, depth 6, 3 heads)",
    "deit_s": "DeiT-S/224 (width 384, depth 12, 6 heads)",
    "dinov2_s14_112": "DINOv2 ViT-S/14 at 112 px (width 384, depth 12, 6 heads, LayerScale)",
}


def dense_model(recipe: str) -> nn.Module:
    if recipe == "main":
        spec = custom_vit_spec(
            img_size=28, patch_size=4, embed_dim=96, depth=6, num_heads=3, in_chans=1, num_classes=10
        )
        return build_model(spec)
    if recipe == "deit_s":
        return timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=1000)
    return timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=112, num_classes=10)


def _align(n: float, d: int) -> int:
    return max(8, min(d, int(round(n / 8)) * 8))


def variant(recipe: str, *, hidden: float = 1.0, heads: int = 0, qk: float = 1.0, drop_blocks: int = 0) -> nn.Module:
    """The dense model of ``recipe`` with every block's MLP at ``hidden`` of its width, ``heads`` heads
    removed, Q/K at ``qk`` of the head dim (multiples of 8), and the last ``drop_blocks`` blocks gone."""
    torch.manual_seed(0)
    m = to_core(dense_model(recipe), method="bench")
    for blk in m.blocks:
        a = blk.attn
        if heads:
            new = Attention(a.qkv.in_features, num_heads=a.num_heads - heads, attn_head_dim=a.head_dim, qkv_bias=True)
            blk.attn = a = core_attention(new)
        if qk < 1.0:
            w = _align(qk * a.head_dim, a.head_dim)
            slice_qk(a, [range(w)] * a.num_heads, width=w)
        if hidden < 1.0:
            slice_hidden(blk, range(_align(hidden * blk.mlp.fc1.out_features, blk.mlp.fc1.out_features)))
    if drop_blocks:
        m.blocks = nn.Sequential(*list(m.blocks)[: len(m.blocks) - drop_blocks])
    return m.eval()


VARIANTS = {  # label -> variant() arguments
    "dense": {},
    "hidden 1/2": {"hidden": 0.5},
    "hidden 1/4": {"hidden": 0.25},
    "one head fewer": {"heads": 1},
    "Q/K 1/2": {"qk": 0.5},
    "two blocks fewer": {"drop_blocks": 2},
    "all: hidden 0.6, one head fewer, Q/K 3/4, one block fewer": {
        "hidden": 0.6,
        "heads": 1,
        "qk": 0.75,
        "drop_blocks": 1,
    },
}


def add_ratio_errors(res: dict) -> None:
    """Each row's error as a ratio to the dense model of its cell (predicted / predicted dense against
    measured / measured dense, both measured interleaved): what the DCS latency search steers by (its
    target is a ratio of the dense model's predicted latency), free of the offset between the table's
    milliseconds and these; and the summary counts over the pruned variants."""
    dense = {(r["recipe"], r["dtype"], r["batch"]): r for r in res["rows"] if r["variant"] == "dense"}
    pruned = []
    for r in res["rows"]:
        d = dense[(r["recipe"], r["dtype"], r["batch"])]
        r["ratio_error_pct"] = 100 * (
            (r["predicted_ms"] / d["predicted_ms"]) / (r["measured_ms"] / d["measured_ms"]) - 1
        )
        if r is not d:
            pruned.append(abs(r["ratio_error_pct"]))
    res["max_abs_ratio_error_pct"] = max(pruned)
    res["within_10pct_ratio"] = sum(e <= 10 for e in pruned)
    res["ratio_cases"] = len(pruned)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default: bench/results/latency_predictor_<cpu>.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=None, help="default: fp32, and bf16 where the device has it")
    ap.add_argument("--iters", type=int, default=20, help="timed rounds of the models (medians)")
    ap.add_argument("--table-iters", type=int, default=7, help="timed rounds per table entry")
    ap.add_argument("--cache", action="store_true", help="read / write the user's table cache (default: measure)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cpu, flags = cpu_info()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    bf16 = device.type == "cuda" or bool({"avx512_bf16", "amx_bf16"} & flags)
    dtypes = args.dtypes or (["fp32", "bf16"] if bf16 else ["fp32"])
    out = args.out or f"bench/results/latency_predictor_{slug(where, 'unknown')}.json"
    res = header()
    res.update(
        device=str(device),
        device_name=where,
        cpu=cpu,
        cpu_flags=sorted(flags & {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
    )
    res.update(iters=args.iters, table_iters=args.table_iters, recipes=RECIPES, rows=[], tables=[])
    t0 = time.perf_counter()
    for recipe in args.recipes:
        models = {label: variant(recipe, **kw) for label, kw in VARIANTS.items()}
        geom = geometry_of(models["dense"])
        for dtype in dtypes:
            dt = runtime.parse_dtype(dtype)
            for B in args.batches:
                t_table = time.perf_counter()
                table = latency_table(
                    geom, device=device, dtype=dtype, batch=B, cache=args.cache, iters=args.table_iters
                )
                t_table = time.perf_counter() - t_table
                res["tables"].append(
                    {"recipe": recipe, "dtype": dtype, "batch": B, "build_s": t_table, **table.to_dict()}
                )
                x = torch.randn(B, geom.in_chans, *geom.img_size, generator=torch.Generator().manual_seed(1))
                x = x.to(device, dt)
                mods = [m.to(device, dt) for m in models.values()]
                load_before = load()
                # the anchor, as the library takes it for a latency goal: the dense model timed now as the
                # table's entries were (profiling.measured_ms), the table's ms scaled by it over its prediction
                anchor = measured_ms(models["dense"], table, device=device) / predict_latency(table, models["dense"])
                with runtime.configured(device):
                    times = time_models(mods, x, warmup=3, iters=args.iters)
                errs = []
                for (label, m), t in zip(models.items(), times):
                    pred, meas = predict_latency(table, m), t * 1e3
                    err = 100 * (pred - meas) / meas
                    anchored = 100 * (pred * anchor - meas) / meas
                    errs.append(abs(err))
                    res["rows"].append(
                        {
                            "recipe": recipe,
                            "dtype": dtype,
                            "batch": B,
                            "variant": label,
                            "measured_ms": meas,
                            "predicted_ms": pred,
                            "error_pct": err,
                            "anchor": anchor,
                            "anchored_error_pct": anchored,
                            "load_before": load_before,
                        }
                    )
                    print(
                        f"{recipe} {dtype} B={B} {label}: measured {meas:.3f} ms, "
                        f"predicted {pred:.3f} ms ({err:+.1f}%; anchored x{anchor:.3f}: {anchored:+.1f}%)",
                        flush=True,
                    )
                print(f"{recipe} {dtype} B={B}: max |error| {max(errs):.1f}% (table {t_table:.0f} s)", flush=True)
    rows = res["rows"]
    res["max_abs_error_pct"] = max(abs(r["error_pct"]) for r in rows)
    res["within_10pct"] = sum(abs(r["error_pct"]) <= 10 for r in rows)
    res["max_abs_anchored_error_pct"] = max(abs(r["anchored_error_pct"]) for r in rows)
    res["within_10pct_anchored"] = sum(abs(r["anchored_error_pct"]) <= 10 for r in rows)
    res["cases"] = len(rows)
    add_ratio_errors(res)
    res["wall_s"] = time.perf_counter() - t0
    save(out, res)
    print(
        f"max |error| {res['max_abs_error_pct']:.1f}% ({res['max_abs_anchored_error_pct']:.1f}% anchored), "
        f"{res['within_10pct']} ({res['within_10pct_anchored']} anchored) of {len(rows)} within 10%; as ratios to "
        f"dense {res['within_10pct_ratio']} of {res['ratio_cases']} "
        f"(max {res['max_abs_ratio_error_pct']:.1f}%) -> {out}"
    )


if __name__ == "__main__":
    main()
