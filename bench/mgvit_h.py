"""Hierarchical MG-ViT (``mgvit-h``) benchmark on Fashion-MNIST: classification and a small
segmentation check, dense PVT v2 against -A and -R on the same data and budget.

1. A dense ``pvt_v2_b0`` is trained from scratch (``nascompress.train.run``) at ``--img-size`` px.
2. From it, with the same data and the same number of fine-tuning epochs: the dense model trained on
   (``fit``, no method: the fair baseline for the extra epochs), ``mgvit-h`` variant ``a`` and
   variant ``r`` (``nascompress.train.finetune``, CE(MG pass) + KL(SGIS)).
3. Classification: test top-1 of each (for -A/-R at epsilon 1 and an epsilon sweep with the SGIS
   exit), per-image MACs (the FLOP counter; the MG layer, sub-token embeddings, ranking and SGIS
   counted), latency (batch 1) and throughput (batch ``--batch``) measured interleaved in this process.
4. Segmentation: foreground masks of the garments (raw pixel > ``--threshold``, resized nearest to the
   input size), an FPN-style head (1x1 laterals to 32 channels on the four stage maps, top-down sum,
   3x3 conv, 2 classes at stride 4, upsampled) on each backbone above (the MG models through
   ``forward_intermediates``: no early exit), backbone and head trained together for the same
   budget; test mIoU (background / foreground), per-image MACs of backbone + head, and the stage
   maps' shapes against the dense model's.

``--variants`` picks the mgvit-h variants (default both); ``--r-pos`` / ``--r-neg`` (PPSM in the proxy
groups, off at 1 / 0) add a row ``r_ppsm``: variant r with the same ``--r-h`` / ``--r-t`` and PPSM on,
fine-tuned, classified and segmented with the same budget as the others.

The machine this was written on has 2 CPU cores shared with other jobs: the defaults are a tiny
budget (see the result's ``budget``); the numbers are what that budget gives, not the paper's setting.

    python bench/mgvit_h.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from _common import ROOT, header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import nascompress  # noqa: E402,F401
from nascompress.data import DataConfig, InputSpec, load_data, make_loader, preprocess  # noqa: E402
from nascompress.profiling.evaluate import evaluate  # noqa: E402
from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.mgvit import sweep_model  # noqa: E402
from nascompress.models.build import ModelSpec, build_model  # noqa: E402
from nascompress.profiling import count_flops, time_models  # noqa: E402
from nascompress.train.loop import fit  # noqa: E402
from _mgvit_h import dense_base  # noqa: E402  (shared with mgvit_h_ppsm and mgvit_h_study)

OUT = ROOT / "bench" / "results" / "mgvit_h.json"
EPSILONS = [0.5, 0.7, 0.9, 0.99, 1.0]
PAPER = {
    "mask_rcnn_gflops": {"pvt_small": 245, "mgvit_a": 258, "mgvit_r": 227},
    "semantic_fpn_gflops": {"pvt_small": 44.5, "mgvit_a": 46.4, "mgvit_r": 41.3},
}


class FPNSeg(nn.Module):
    """A small FPN-style segmentation head on a backbone's four stage maps (timm forward_intermediates)."""

    def __init__(self, backbone: nn.Module, chans: list[int], dim: int = 32, classes: int = 2):
        super().__init__()
        self.backbone = backbone
        self.lateral = nn.ModuleList(nn.Conv2d(c, dim, 1) for c in chans)
        self.smooth = nn.Conv2d(dim, dim, 3, padding=1)
        self.cls = nn.Conv2d(dim, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.backbone.forward_intermediates(x, intermediates_only=True)
        y = self.lateral[-1](feats[-1])
        for f, lat in zip(reversed(feats[:-1]), reversed(list(self.lateral[:-1]))):
            y = lat(f) + F.interpolate(y, size=f.shape[-2:], mode="nearest")
        y = self.cls(F.relu(self.smooth(y)))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


def masks_of(imgs: torch.Tensor, size: tuple[int, int], threshold: int) -> torch.Tensor:
    """Raw uint8 images (B, 1, 28, 28) -> foreground labels (B, H, W) at the model's input size."""
    m = (imgs[:, :1] > threshold).float()
    return F.interpolate(m, size=size, mode="nearest")[:, 0].long()


def seg_run(backbone: nn.Module, data, spec: InputSpec, args, seed: int = 0) -> dict:
    """One segmentation run: the head initialised and the images shuffled from ``seed``."""
    with torch.no_grad():
        chans = [
            f.shape[1]
            for f in backbone.forward_intermediates(
                torch.zeros(1, spec.in_chans, *spec.img_size), intermediates_only=True
            )
        ]
    torch.manual_seed(seed)
    model = FPNSeg(copy.deepcopy(backbone), chans).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.seg_lr, weight_decay=0.01)
    t0 = time.time()
    steps = 0
    for epoch in range(args.seg_epochs):
        for imgs, _ in make_loader(data.train, batch_size=args.seg_batch, shuffle=True, seed=seed, epoch=epoch):
            x, y = preprocess(imgs, spec), masks_of(imgs, spec.img_size, args.threshold)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
    train_s = time.time() - t0
    model.eval()
    inter = torch.zeros(2)
    union = torch.zeros(2)
    with torch.no_grad():
        for imgs, _ in make_loader(data.test, batch_size=128, shuffle=False):
            pred = model(preprocess(imgs, spec)).argmax(1)
            y = masks_of(imgs, spec.img_size, args.threshold)
            for c in range(2):
                inter[c] += ((pred == c) & (y == c)).sum()
                union[c] += ((pred == c) | (y == c)).sum()
        flops = count_flops(model, torch.randn(2, spec.in_chans, *spec.img_size))
    iou = (inter / union.clamp_min(1)).tolist()
    return {
        "miou": 100 * sum(iou) / 2,
        "iou_background": 100 * iou[0],
        "iou_foreground": 100 * iou[1],
        "flops": flops.total,
        "mflops": flops.total / 1e6,
        "params": flops.params,
        "train_steps": steps,
        "train_s": train_s,
    }


def reference_224() -> dict:
    """Per-image GFLOPs at 224 px (the paper's 7x7 coarse grid, r_h 0.1, r_t 0.4; random weights: counts
    do not depend on them) of pvt_v2_b0 and pvt_v2_b2 (the PVT v2 counterpart of the paper's PVT-Small):
    dense, -A and -R (the MG pass; the SGIS at 112 px on top for an image that does not exit)."""
    out = {}
    x = torch.randn(1, 3, 224, 224)
    for name in ("pvt_v2_b0", "pvt_v2_b2"):
        d = build_model(ModelSpec(name, {})).eval()
        row = {"dense_gflops": count_flops(d, x).total / 1e9}
        for v in ("a", "r"):
            m, rec = get_method("mgvit-h").prepare_fresh(copy.deepcopy(d), {"variant": v})
            st = m.eval().stage_flops()
            row[v] = {
                "mg_pass_gflops": st["mgis_flops"] / 1e9,
                "sgis_gflops": st["sgis_flops"] / 1e9,
                "vs_dense": st["mgis_flops"] / 1e9 / row["dense_gflops"],
                "cells_split": rec["cells_split"],
            }
        out[name] = row
    return out


def stage_shapes(model: nn.Module, spec: InputSpec) -> list[list[int]]:
    """(C, H, W) of each stage map ``forward_intermediates`` gives for one image."""
    with torch.no_grad():
        feats = model.forward_intermediates(torch.zeros(1, spec.in_chans, *spec.img_size), intermediates_only=True)
    return [list(f.shape[1:]) for f in feats]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--img-size", type=int, default=64)
    ap.add_argument("--train-limit", type=int, default=800)
    ap.add_argument("--eval-limit", type=int, default=400)
    ap.add_argument("--epochs", type=int, default=2, help="dense training epochs")
    ap.add_argument("--ft-epochs", type=int, default=1, help="fine-tuning epochs (dense, -A, -R alike)")
    ap.add_argument("--ft-lr", type=float, default=2e-4)
    ap.add_argument("--kl-weight", type=float, default=1.0, help="mgvit-h recipe: the SGIS KL term's weight")
    ap.add_argument("--skip-seg", action="store_true", help="classification only")
    ap.add_argument("--reuse-base", action="store_true", help="reuse the dense run in --runs if it is finished")
    ap.add_argument(
        "--r-h",
        type=float,
        default=0.25,
        help="head share (the paper's 0.1 makes no head cell of a 64 px image's 2x2 grid)",
    )
    ap.add_argument("--r-t", type=float, default=0.75)
    ap.add_argument("--variants", default="a,r", help="mgvit-h variants fine-tuned: a,r / a / r")
    ap.add_argument(
        "--r-pos",
        type=float,
        default=1.0,
        help="PPSM positive share of the split cells; below 1 (or --r-neg above 0) adds the row r_ppsm",
    )
    ap.add_argument("--r-neg", type=float, default=0.0, help="PPSM negative share of the split cells (r_ppsm)")
    ap.add_argument("--seg-epochs", type=int, default=1)
    ap.add_argument(
        "--seg-seeds",
        default="0",
        help="segmentation runs per backbone, one per seed (head init and shuffle): 0 / 0,1,2; mIoU is their mean",
    )
    ap.add_argument("--seg-limit", type=int, default=400)
    ap.add_argument("--seg-batch", type=int, default=32)
    ap.add_argument("--seg-lr", type=float, default=1e-3)
    ap.add_argument("--threshold", type=int, default=25, help="foreground: raw pixel > this (0..255)")
    ap.add_argument("--batch", type=int, default=64, help="throughput batch")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default=str(ROOT / "runs"))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--reference-only",
        action="store_true",
        help="only add the 224 px FLOP reference (reference_224) to the existing --out file",
    )
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - {"a", "r"}:
        ap.error(f"--variants takes a, r or a,r, got {args.variants!r}")
    rows = {v: {"variant": v, "r_h": args.r_h, "r_t": args.r_t} for v in variants}
    if args.r_pos < 1 or args.r_neg > 0:
        rows["r_ppsm"] = {"variant": "r", "r_h": args.r_h, "r_t": args.r_t, "r_pos": args.r_pos, "r_neg": args.r_neg}
    torch.set_num_threads(args.threads)
    if args.reference_only:
        res = json.loads(Path(args.out).read_text())
        res["reference_224"] = reference_224()
        save(args.out, res)
        print(json.dumps(res["reference_224"], indent=1))
        return
    t_start = time.time()
    runs = Path(args.runs)
    data_cfg = DataConfig(train_limit=args.train_limit, eval_limit=args.eval_limit)
    res = {**header(), "budget": vars(args), "paper_reference": PAPER}

    # 1. dense base
    base = runs / f"bench_mgvith_dense{args.img_size}"
    dense, spec, data = dense_base(
        base, data_cfg, res, img_size=args.img_size, epochs=args.epochs, reuse=args.reuse_base
    )
    res["dense_base_s"] = time.time() - t_start

    # 2. the same fine-tuning budget for dense, -A, -R
    # keep="last": the trained models are compared (with one epoch, a fine-tune that does not beat its
    # start on validation would otherwise hand back its starting model: -A at init is the dense model)
    cfg = finetune_train_config("mgvit-h", epochs=args.ft_epochs, batch_size=64, lr=args.ft_lr, seed=0, keep="last")
    models = {}
    t0 = time.time()
    dense_ft = copy.deepcopy(dense)
    fit(dense_ft, data=data, input_spec=spec, cfg=cfg)
    models["dense"] = dense_ft.eval()
    timing = {"dense": time.time() - t0}
    for v, config in rows.items():
        t0 = time.time()
        out = runs / f"bench_mgvith_{v}{args.img_size}"
        finetune(
            FinetuneJob(
                run_dir=str(base),
                method="mgvit-h",
                out=str(out),
                data=data_cfg,
                train=cfg,
                config=config,
                recipe={"kl_weight": args.kl_weight},
            ),
            force=True,
        )
        models[v], arch = load_with_arch(out)
        models[v].eval()
        if v == "r_ppsm":
            res["r_ppsm_record"] = {k: arch["methods"][-1][k] for k in ("cells_split", "ppsm_cells", "mg_group_tokens")}
        timing[v] = time.time() - t0
    res["finetune_s"] = timing

    # 3. classification
    x1 = torch.randn(1, 1, *spec.img_size)
    cls = {}
    batches = [(preprocess(i, spec), y) for i, y in make_loader(data.test, batch_size=256, shuffle=False)]
    for name, m in models.items():
        e = evaluate(m, data.test, input_spec=spec, device=torch.device("cpu"))
        row = {"test_top1": e.top1, "test_n": e.n}
        if name == "dense":
            f = count_flops(m, x1)
            row.update(flops=f.total, mflops=f.total / 1e6, params=f.params)
        else:
            st = m.stage_flops()
            row.update(
                flops=m.mean_flops(0.0, 1.0),
                mflops=m.mean_flops(0.0, 1.0) / 1e6,
                params=sum(p.numel() for p in m.parameters()),
                stages=st,
                config=m.mg,
            )
            sw = sweep_model(m, batches, epsilons=EPSILONS)
            row.update(sweep=[r.to_dict() for r in sw.rows], sgis_top1=sw.sgis_top1, mgis_top1=sw.mgis_top1)
        cls[name] = row
    xb = batches[0][0][: args.batch]
    timed = [models["dense"]]
    labels = ["dense"]
    for v in rows:
        for eps in (1.0, 0.9):
            m = copy.deepcopy(models[v])
            m.mg = dict(m.mg, epsilon=eps)
            timed.append(m)
            labels.append(f"{v}_eps{eps:g}")
    with torch.no_grad():
        lat = time_models(timed, xb[:1], warmup=2, iters=args.iters)
        thr = time_models(timed, xb, warmup=1, iters=args.iters)
    res["speed"] = {
        lab: {"latency_ms": 1e3 * lt, "throughput_img_s": xb.shape[0] / t, "batch": xb.shape[0]}
        for lab, lt, t in zip(labels, lat, thr)
    }
    res["classification"] = cls
    save(args.out, res)

    if args.skip_seg:
        res["total_s"] = time.time() - t_start
        save(args.out, res)
        return
    # 4. segmentation
    seg_data = load_data(DataConfig(train_limit=args.seg_limit, eval_limit=args.eval_limit), spec=spec)
    seeds = [int(v) for v in args.seg_seeds.split(",")]
    res["segmentation"] = {}
    for name, m in models.items():
        per_seed = [seg_run(m, seg_data, spec, args, seed) for seed in seeds]
        row = dict(per_seed[0])
        for key in ("miou", "iou_background", "iou_foreground"):
            vals = [r[key] for r in per_seed]
            row[key] = sum(vals) / len(vals)
            if len(vals) > 1:
                row[f"{key}_per_seed"] = vals
                row[f"{key}_std"] = float(torch.tensor(vals).std())
        row.update(seeds=seeds, train_s=sum(r["train_s"] for r in per_seed))
        res["segmentation"][name] = row
    dense_shapes = stage_shapes(models["dense"], spec)
    for name, m in models.items():
        shapes = stage_shapes(m, spec)
        res["segmentation"][name].update(stage_shapes=shapes, same_shapes_as_dense=shapes == dense_shapes)
    res["total_s"] = time.time() - t_start
    save(args.out, res)
    for name in models:
        c, s = cls[name], res["segmentation"][name]
        print(
            f"{name}: top-1 {c['test_top1']:.2f}%  {c['mflops']:.2f} MFLOPs  |  seg mIoU {s['miou']:.2f}  "
            f"{s['mflops']:.2f} MFLOPs",
            flush=True,
        )


if __name__ == "__main__":
    main()
