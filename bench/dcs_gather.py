"""DCS's materialized MLP reads and writes only its kept residual channels: which form of that
selection is fastest here (``MaterializedBlock.mlp_half``)?

Forms, each the MLP half of one block (LN2, fc1, GELU, fc2, LayerScale, residual add), inference,
timed interleaved in one process (medians), against the dense block (no selection):

* ``gather_2d`` (the module's form): ``index_select`` of the kept channels on a (B*N, C) view after
  LN2, ``index_add_`` of the MLP output back into the residual stream on the same view;
* ``gather_3d``: the same along dim -1 of the (B, N, C) tensors;
* ``fold``: the selection folded into the weights: fc1 reads all C channels (zero columns where
  a channel is not kept), fc2 writes all C (zero rows); no gather, no scatter, full-width FLOPs;
* ``compiled``: ``torch.compile`` (Inductor) of the module's form, which can fuse the gather into
  LN2 and the scatter into the residual add.

Kept channels are chosen by weight magnitude (the share given, the count rounded to ``--align``:
8, what the aligned DCS materialization keeps, and 1, the exact count) through the method's own
materialize path (``methods.dcs.slice_mlp``). Every form is checked equal to ``gather_2d``.

    python bench/dcs_gather.py --out bench/results/dcs_gather_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import time

from _common import header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402,F401
from nascompress.models.layers import NCBlock, aligned_width, to_core  # noqa: E402
from nascompress.methods.dcs_importance import channel_importance
from nascompress.methods.dcs_materialize import slice_mlp  # noqa: E402
from nascompress.models.build import ModelSpec, build_model  # noqa: E402
from nascompress.profiling import time_models  # noqa: E402

# (label, width, heads, tokens, batches)
CASES = [("main job (96 wide, 50 tokens)", 96, 3, 50, (1, 64)), ("DeiT-S (384 wide, 197 tokens)", 384, 6, 197, (1, 64))]


def block_pair(dim: int, heads: int, keep: float, align: int, seed: int = 0):
    """(dense block, materialized block) of a ViT with ``dim`` channels, ``keep`` of its MLP's
    residual channels kept (largest weight-magnitude importance; the count rounded up to ``align``)."""
    torch.manual_seed(seed)
    m = build_model(
        ModelSpec(
            "vit_tiny_patch16_224",
            dict(embed_dim=dim, num_heads=heads, depth=1, num_classes=10, img_size=32, patch_size=4, init_values=0.1),
        )
    )
    blk = to_core(m, method="dcs").blocks[0].eval()
    dense = copy.deepcopy(blk)
    imp, _ = channel_importance(blk)
    k = aligned_width(round(keep * dim), align=align, full=dim)
    slice_mlp(blk, imp.topk(k).indices.sort().values.tolist())
    return dense, blk


def folded(mat) -> torch.nn.Module:
    """The materialized block with its selection folded into full-width fc1 / fc2 / ls2."""
    blk = copy.deepcopy(mat)
    keep, C = mat.mlp_keep, mat.norm2.normalized_shape[0]
    fc1, fc2 = blk.mlp.fc1, blk.mlp.fc2
    w1 = fc1.weight.new_zeros(fc1.out_features, C).index_copy_(1, keep, fc1.weight.detach())
    w2 = fc2.weight.new_zeros(C, fc2.in_features).index_copy_(0, keep, fc2.weight.detach())
    b2 = fc2.bias.new_zeros(C).index_copy_(0, keep, fc2.bias.detach())
    new1, new2 = torch.nn.Linear(C, fc1.out_features), torch.nn.Linear(fc2.in_features, C)
    with torch.no_grad():
        new1.weight.copy_(w1)
        new1.bias.copy_(fc1.bias)
        new2.weight.copy_(w2)
        new2.bias.copy_(b2)
    blk.mlp.fc1, blk.mlp.fc2 = new1, new2
    if hasattr(blk.ls2, "gamma"):
        blk.ls2.gamma = torch.nn.Parameter(blk.ls2.gamma.new_zeros(C).index_copy_(0, keep, blk.ls2.gamma.detach()))
    return blk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/dcs_gather_cpu.json")
    ap.add_argument("--keep", default="0.6,0.8", help="shares of the residual channels the MLP keeps")
    ap.add_argument("--align", default="8,1", help="kept counts rounded up to these multiples")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = header()
    res.update(iters=args.iters, rows=[])
    t0 = time.perf_counter()
    for label, dim, heads, tokens, batches in CASES:
        for keep, align in ((float(k), int(a)) for k in args.keep.split(",") for a in args.align.split(",")):
            dense, mat = block_pair(dim, heads, keep, align)
            fold = folded(mat)
            fold.__class__ = NCBlock  # the plain MLP half over full-width weights
            forms = {
                "dense": dense.mlp_half,
                "gather_2d": mat.mlp_half,
                "gather_3d": lambda x, b=mat: x.index_add(
                    -1, b.mlp_keep, b.drop_path2(b.ls2(b.mlp(b.norm2(x).index_select(-1, b.mlp_keep))))
                ),
                "fold": fold.mlp_half,
            }
            if not args.no_compile:
                torch._dynamo.reset()
                forms["compiled"] = torch.compile(copy.deepcopy(mat).mlp_half, dynamic=False)
            for B in batches:
                x = torch.randn(B, tokens, dim, generator=torch.Generator().manual_seed(1))
                with torch.inference_mode():
                    ref = mat.mlp_half(x.clone())
                    diffs = {k: (f(x.clone()) - ref).abs().max().item() for k, f in forms.items() if k != "dense"}
                names = list(forms)
                fns = [lambda x, f=forms[k]: f(x.clone()) for k in names]  # index_add_ works in place: a fresh x
                times = time_models(fns, x, warmup=3, iters=args.iters)
                clone_t = time_models([lambda x: x.clone()], x, warmup=2, iters=args.iters)[0]
                row = {
                    "case": label,
                    "batch": B,
                    "tokens": tokens,
                    "width": dim,
                    "kept": int(mat.mlp_keep.numel()),
                    "keep_share": keep,
                    "align": align,
                    "clone_ms": clone_t * 1e3,
                    "ms": {k: t * 1e3 for k, t in zip(names, times)},
                    "speedup_vs_dense": {k: times[0] / t for k, t in zip(names, times)},
                    "max_abs_diff_vs_gather_2d": diffs,
                }
                row["fastest_selection_form"] = min((k for k in names if k != "dense"), key=lambda k: row["ms"][k])
                res["rows"].append(row)
                print(
                    label,
                    f"B={B} keep={keep} kept={row['kept']}:",
                    {k: round(v, 3) for k, v in row["ms"].items()},
                    "fastest",
                    row["fastest_selection_form"],
                    flush=True,
                )
    res["wall_s"] = time.perf_counter() - t0
    save(args.out, res)


if __name__ == "__main__":
    main()
