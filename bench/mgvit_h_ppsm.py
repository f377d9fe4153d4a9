"""Hierarchical MG-ViT's PPSM in the proxy groups (``mgvit-h`` ``r_pos`` / ``r_neg``): what it saves and
what it costs, on the tiny configuration of ``bench/mgvit_h.py`` (``pvt_v2_b0`` at 64 px, Fashion-MNIST).

1. The dense base: ``--base`` (a finished ``bench/mgvit_h.py`` dense run, e.g. its ``--reuse-base``
   one) or, if it does not exist, trained here exactly as ``bench/mgvit_h.py`` trains it.
2. For each ``--configs`` pair ``r_pos,r_neg`` (``1,0``: PPSM off), variant ``--variant`` with the same
   ``--r-h`` / ``--r-t``, fine-tuned with the same budget (``nascompress.train.finetune``, ``kl_weight``
   ``--kl-weight``): test top-1 of the MG pass (epsilon 1), its per-image MACs (the FLOP counter: the
   MG layer over the slimmed groups and the merges counted), the cells per PPSM domain and the
   tokens the MG layer sees (arch.json's ``ppsm_cells`` / ``mg_group_tokens``).
3. ``same_weights``: each PPSM setting applied to the weights fine-tuned with PPSM off (no training
   with it): the effect of the slimming alone.

    python bench/mgvit_h_ppsm.py --base /path/to/bench_mgvith_dense64 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from _common import ROOT, header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402,F401
from nascompress.data import DataConfig  # noqa: E402
from nascompress.profiling.evaluate import evaluate  # noqa: E402
from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from _mgvit_h import dense_base  # noqa: E402  (the same dense base)

OUT = ROOT / "bench" / "results" / "mgvit_h_ppsm.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--img-size", type=int, default=64)
    ap.add_argument("--train-limit", type=int, default=800)
    ap.add_argument("--eval-limit", type=int, default=400)
    ap.add_argument("--epochs", type=int, default=2, help="dense training epochs (only if --base is missing)")
    ap.add_argument("--ft-epochs", type=int, default=1)
    ap.add_argument("--ft-lr", type=float, default=2e-4)
    ap.add_argument("--kl-weight", type=float, default=0.0, help="0: the MG pass alone (no exit is used here)")
    ap.add_argument("--variant", default="r")
    ap.add_argument("--r-h", type=float, default=0.25)
    ap.add_argument("--r-t", type=float, default=0.25, help="64 px, r_h 0.25, r_t 0.25: 3 of the 4 cells split")
    ap.add_argument(
        "--configs", nargs="+", default=["1,0", "0.5,0.1", "0,0.5"], help="r_pos,r_neg pairs; 1,0 is PPSM off"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", default=None, help="a dense pvt_v2_b0 run at --img-size (trained here if missing)")
    ap.add_argument("--runs", default=str(ROOT / "runs"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    runs = Path(args.runs)
    data_cfg = DataConfig(train_limit=args.train_limit, eval_limit=args.eval_limit)
    res = {**header(), "budget": vars(args)}
    base = Path(args.base) if args.base else runs / f"bench_mgvith_dense{args.img_size}"
    dense, spec, data = dense_base(base, data_cfg, res, img_size=args.img_size, epochs=args.epochs, reuse=True)
    cfg = finetune_train_config("mgvit-h", epochs=args.ft_epochs, batch_size=64, lr=args.ft_lr, seed=0, keep="last")
    pairs = [tuple(float(v) for v in c.split(",")) for c in args.configs]
    rows, trained = [], {}
    for r_pos, r_neg in pairs:
        t0 = time.time()
        out = runs / f"bench_mgvith_ppsm_{args.variant}{args.img_size}_{r_pos:g}_{r_neg:g}"
        config = {"variant": args.variant, "r_h": args.r_h, "r_t": args.r_t, "r_pos": r_pos, "r_neg": r_neg}
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
        m, a = load_with_arch(out)
        m.eval()
        rec = a["methods"][-1]
        e = evaluate(m, data.test, input_spec=spec, device=torch.device("cpu"))
        st = m.stage_flops()
        trained[(r_pos, r_neg)] = m
        rows.append(
            {
                "r_pos": r_pos,
                "r_neg": r_neg,
                "test_top1": e.top1,
                "test_n": e.n,
                "mg_pass_flops": st["mgis_flops"],
                "mg_pass_mflops": st["mgis_flops"] / 1e6,
                "ppsm_cells": rec["ppsm_cells"],
                "cells_split": rec["cells_split"],
                "mg_group_tokens": rec["mg_group_tokens"],
                "finetune_s": time.time() - t0,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    res["finetuned"] = rows
    # the slimming alone: each setting on the weights fine-tuned with PPSM off
    same = []
    off = trained.get((1.0, 0.0))
    if off is not None:
        for r_pos, r_neg in pairs:
            m, rec = get_method("mgvit-h").prepare_fresh(
                copy.deepcopy(dense),
                {"variant": args.variant, "r_h": args.r_h, "r_t": args.r_t, "r_pos": r_pos, "r_neg": r_neg},
            )
            m.load_state_dict(off.state_dict())
            m.eval()
            e = evaluate(m, data.test, input_spec=spec, device=torch.device("cpu"))
            same.append(
                {
                    "r_pos": r_pos,
                    "r_neg": r_neg,
                    "test_top1": e.top1,
                    "mg_pass_mflops": m.stage_flops()["mgis_flops"] / 1e6,
                    "ppsm_cells": rec["ppsm_cells"],
                }
            )
            print("same weights", json.dumps(same[-1]), flush=True)
    res["same_weights"] = same
    dense_f = count_flops(dense.eval(), torch.randn(1, 1, args.img_size, args.img_size)).total
    res["dense_mflops"] = dense_f / 1e6
    res["note"] = (
        "PPSM slims only the finer tokens of the proxy groups (the MG layer's keys and values); the "
        "sub-token embeddings and every stage stay as they are, so its saving is a small share of the "
        "MG pass. Tiny budget on shared CPU cores: one seed, 400 test images (1 image = 0.25 pt)."
    )
    res["total_s"] = time.time() - t_start
    save(args.out, res)


if __name__ == "__main__":
    main()
