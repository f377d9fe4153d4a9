"""How a narrowed Q/K (fewer channels than V, as DCS and uniform pruning leave it) should reach the
attention kernel on this device: ``packed`` (SDPA gets q/k at their narrowed width; on the CPU
torch's fused kernel needs one head dim for q, k and v, so this is the math path) or ``pad`` (q/k
zero-padded after the projection to V's head dim; the fused kernel runs, QK^T at the full width).

Times one whole :class:`~nascompress.models.layers.NCAttention` forward (projection, kernel, output
projection), the dense attention and both layouts interleaved in one process, medians; inference.
The figures decide ``layers.CPU_PAD_QK``; on CUDA ``bench/gpu.py`` measures the same choice.

    python bench/qk_layout.py --out bench/results/qk_layout_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import time

from _common import header, save  # noqa: E402  (puts the repository on sys.path)

import torch

import nascompress  # noqa: F401  (before timm: the torchvision fix)
from timm.layers import Attention  # noqa: E402

from nascompress.models.layers import core_attention, set_qk_layout
from nascompress.models.slicing import slice_qk
from nascompress.profiling import time_models

# (label, width, heads, tokens, batches, Q/K widths kept per head)
CASES = [
    ("main job (96 wide, 3 heads, 50 tokens)", 96, 3, 50, (1, 64), (8, 16, 24)),
    ("DeiT-S (384 wide, 6 heads, 197 tokens)", 384, 6, 197, (1, 16), (16, 32, 40, 48, 56)),
    ("DINOv2 ViT-S/14 at 112 px (384 wide, 6 heads, 65 tokens)", 384, 6, 65, (1, 64), (32, 48)),
]


def attention(dim: int, heads: int, kept: int | None, *, device: torch.device, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    a = core_attention(Attention(dim, heads, qkv_bias=True)).to(device, dtype).eval()
    if kept is not None:
        g = torch.Generator().manual_seed(seed)
        hd = dim // heads
        slice_qk(a, [torch.randperm(hd, generator=g)[:kept].tolist() for _ in range(heads)])
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/qk_layout_cpu.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default); on a shared machine 1 keeps the timings steadier",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    res = header()
    res.update(device=str(device), dtype=args.dtype, iters=args.iters, rows=[])
    t0 = time.perf_counter()
    for label, dim, heads, tokens, batches, widths in CASES:
        for B in batches:
            x = torch.randn(B, tokens, dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            dense = attention(dim, heads, None, device=device, dtype=dtype)
            for w in widths:
                packed = attention(dim, heads, w, device=device, dtype=dtype)
                pad = copy.deepcopy(packed)
                set_qk_layout(packed, "packed")
                set_qk_layout(pad, "pad")
                with torch.inference_mode():
                    err = (packed(x) - pad(x)).abs().max().item()
                t_dense, t_packed, t_pad = time_models([dense, packed, pad], x, warmup=3, iters=args.iters)
                row = {
                    "case": label,
                    "batch": B,
                    "tokens": tokens,
                    "head_dim": dim // heads,
                    "qk_width": w,
                    "dense_ms": t_dense * 1e3,
                    "packed_ms": t_packed * 1e3,
                    "pad_ms": t_pad * 1e3,
                    "pad_speedup_over_packed": t_packed / t_pad,
                    "packed_vs_dense": t_dense / t_packed,
                    "pad_vs_dense": t_dense / t_pad,
                    "max_abs_diff_packed_pad": err,
                }
                res["rows"].append(row)
                print(
                    f"{label} B={B} qk={w}: dense {row['dense_ms']:.3f} ms, packed {row['packed_ms']:.3f}, "
                    f"pad {row['pad_ms']:.3f} (pad {row['pad_speedup_over_packed']:.2f}x packed)",
                    flush=True,
                )
    rows = res["rows"]
    res["pad_faster_in"] = sum(r["pad_speedup_over_packed"] > 1 for r in rows)
    res["cases"] = len(rows)
    res["wall_s"] = time.perf_counter() - t0
    save(args.out, res)
    print(f"pad faster in {res['pad_faster_in']} of {len(rows)} cases -> {args.out}")


if __name__ == "__main__":
    main()
