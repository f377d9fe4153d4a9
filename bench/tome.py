"""ToMe zero-shot on a pretrained base: accuracy and FLOPs per r, EViT at the same FLOPs, CPU speed.

For each ``r`` (tokens merged at every layer): the FLOPs ratio to the dense model (the project's
profiler: the matching, merge and size bias included), zero-shot top-1 on a fixed class-balanced
validation subset (the search's trial objective), and EViT at its papers' layers (4, 7, 10 of 12,
scaled to the depth) with one keep rate bisected until its FLOPs equal ToMe's, scored on the same
images. Speed: the dense model, ToMe and that EViT timed interleaved (medians) at batch 64 (and
batch 1) on random inputs; ``speedup / flops_reduction`` is the share of the FLOPs reduction that
the CPU turns into speed (the issue's goal: >= 0.8). ``--deit`` adds DeiT-S at 224 px (random
weights: speed and FLOPs only).

    python bench/tome.py --base runs/pretrained/dense --r 4,8,12 --eval-images 1000
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import _common  # noqa: F401  (the repository's nascompress first on sys.path)
from _common import header, save

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
import timm  # noqa: E402
import torch  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.tokens import scale_layers  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.profiling.latency import time_models  # noqa: E402
from nascompress.studies.trials import SearchJob
from nascompress.studies.trial_context import TrialContext  # noqa: E402


def evit_at(
    base: torch.nn.Module, target: float, x: torch.Tensor, dense: float
) -> tuple[torch.nn.Module, float, float]:
    """EViT at the papers' layers with the keep rate whose FLOPs ratio is closest to ``target``."""
    layers = scale_layers(len(base.blocks))
    lo, hi, best = 0.02, 1.0, None
    for _ in range(18):
        kr = (lo + hi) / 2
        m, _ = get_method("evit").prepare_fresh(copy.deepcopy(base), {"keep_rate": kr, "prune_layers": layers})
        ratio = count_flops(m.eval(), x).total / dense
        if best is None or abs(ratio - target) < abs(best[2] - target):
            best = (m, kr, ratio)
        lo, hi = (kr, hi) if ratio < target else (lo, kr)
    return best


def speeds(models: list[torch.nn.Module], shape: tuple[int, ...], *, batch: int, iters: int) -> list[float]:
    """Images per second of each model at ``batch`` (interleaved medians)."""
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(0))
    return [batch / t for t in time_models(models, x, warmup=2, iters=iters)]


def deit_speed(rs: list[int], iters: int) -> dict[str, Any]:
    dense = timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=1000).eval()
    x = torch.randn(2, 3, 224, 224)
    d_flops = count_flops(dense, x).total
    out: dict[str, Any] = {"dense_gflops": d_flops / 1e9, "rows": []}
    for r in rs:
        m, _ = get_method("tome").prepare_fresh(copy.deepcopy(dense), {"r": r})
        ratio = count_flops(m.eval(), x).total / d_flops
        ev, kr, ev_ratio = evit_at(dense, ratio, x, d_flops)
        s = speeds([dense, m, ev], (3, 224, 224), batch=64, iters=iters)
        out["rows"].append(
            {
                "r": r,
                "flops_ratio": ratio,
                "gflops": ratio * d_flops / 1e9,
                "speedup_b64": s[1] / s[0],
                "speedup_over_flops_reduction": (s[1] / s[0]) * ratio,
                "evit_keep_rate": kr,
                "evit_flops_ratio": ev_ratio,
                "evit_speedup_b64": s[2] / s[0],
            }
        )
        print("deit", out["rows"][-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="a pretrained run (e.g. the DINOv2 ViT-S/14 linear probe)")
    ap.add_argument("--r", default="4,8,12")
    ap.add_argument("--eval-images", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=7, help="timed rounds (medians)")
    ap.add_argument("--deit", action="store_true", help="also time DeiT-S at 224 px (random weights)")
    ap.add_argument("--out", default="bench/results/tome_dinov2.json")
    a = ap.parse_args()
    rs = [int(v) for v in a.r.split(",")]
    t0 = time.time()
    ctx = TrialContext(
        SearchJob(
            base=a.base,
            space="tome",
            study="bench",
            eval_images=a.eval_images,
            train_images=64,
            calib_steps=0,
            batch_size=64,
        )
    )
    base, x, dense = ctx.base, ctx.flops_x, ctx.dense_flops
    shape = tuple(x.shape[1:])
    res: dict[str, Any] = {
        **header(),
        "base": a.base,
        "eval_images": len(ctx.data.val),
        "input": list(shape),
        "dense_gflops": dense / 1e9,
        "dense_top1": ctx.accuracy(base),
        "rows": [],
    }
    print("dense", res["dense_top1"], flush=True)
    for r in rs:
        m, _ = get_method("tome").prepare_fresh(copy.deepcopy(base), {"r": r})
        ratio = count_flops(m.eval(), x).total / dense
        ev, kr, ev_ratio = evit_at(base, ratio, x, dense)
        s64 = speeds([base, m, ev], shape, batch=64, iters=a.iters)
        s1 = speeds([base, m, ev], shape, batch=1, iters=3 * a.iters)
        row = {
            "r": r,
            "flops_ratio": ratio,
            "top1": ctx.accuracy(m),
            "speedup_b64": s64[1] / s64[0],
            "speedup_b1": s1[1] / s1[0],
            "speedup_over_flops_reduction_b64": (s64[1] / s64[0]) * ratio,
            "evit": {
                "keep_rate": kr,
                "prune_layers": scale_layers(len(base.blocks)),
                "flops_ratio": ev_ratio,
                "top1": ctx.accuracy(ev),
                "speedup_b64": s64[2] / s64[0],
                "speedup_b1": s1[2] / s1[0],
            },
            "dense_images_per_s_b64": s64[0],
        }
        res["rows"].append(row)
        print(row, flush=True)
    if a.deit:
        res["deit_small_224_random_weights"] = deit_speed(rs, a.iters)
    res["wall_s"] = time.time() - t0
    save(a.out, res)


if __name__ == "__main__":
    main()
