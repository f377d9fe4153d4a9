"""A small Optuna study over ``search_spaces/mgvit-h.yaml`` (Hierarchical MG-ViT: variant, r_h, r_t, r_pos,
r_neg, epsilon) on the tiny trained ``pvt_v2_b0`` of ``bench/mgvit_h.py``, through the project's own
``search tokens`` machinery (``nascompress.studies.trials.run_search``).

1. The dense base: ``--base`` (a finished ``bench/mgvit_h.py`` dense run) or, if it does not exist,
   trained here exactly as ``bench/mgvit_h.py`` trains it (``dense_base``).
2. ``run_search``: NSGA-II over the space (the paper's configuration enqueued first), each trial scored
   as every study trial is: the base with the trial's mgvit-h settings, fine-tuned ``--finetune-epochs``
   on ``--train-images`` class-balanced training images (mgvit-h's recipe: CE of the MG pass + KL of
   the SGIS), top-1 on ``--eval-images`` class-balanced validation images (the early exit at the
   trial's epsilon included), FLOPs per image over 32 of those images (the SGIS, and the MG pass for
   the images that do not exit) against the dense model.
3. Recorded: every trial (parameters, top-1, FLOPs, cells split, PPSM domains), which values each of
   the space's parameters took (``coverage``), the dense base's top-1 on the same validation subset,
   and the Pareto front as ``nascompress study show`` reports it (``nascompress.studies.inspect.show_study``).

    python bench/mgvit_h_study.py --base runs/bench_mgvith_dense64 --trials 10 --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _common import ROOT, header, save  # noqa: E402  (puts the repository on sys.path)

import optuna  # noqa: E402
import torch  # noqa: E402

import nascompress  # noqa: E402,F401
from nascompress.data import DataConfig  # noqa: E402
from nascompress.studies.space_model import load_space  # noqa: E402
from nascompress.studies.trials import SearchJob, run_search
from nascompress.studies.trial_context import TrialContext  # noqa: E402
from nascompress.studies.inspect import load as load_study  # noqa: E402
from nascompress.studies.inspect import show_study  # noqa: E402
from nascompress.studies.records import trial_record  # noqa: E402
from _mgvit_h import dense_base  # noqa: E402  (the same dense base)

OUT = ROOT / "bench" / "results" / "mgvit_h_study.json"
SPACE = "mgvit-h"  # the shipped space (nascompress/search_spaces/mgvit-h.yaml)


def trial_row(t: optuna.trial.FrozenTrial) -> dict:
    rec = trial_record(t)
    arch = rec.arch[0]
    return {
        "trial": t.number,
        "params": dict(t.params),
        "accuracy": rec.accuracy,
        "flops_ratio": rec.flops_ratio,
        "mflops": rec.flops / 1e6,
        "cells_split": arch["cells_split"],
        "ppsm_cells": arch["ppsm_cells"],
        "mg_group_tokens": arch["mg_group_tokens"],
        "wall_s": rec.wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None, help="a dense pvt_v2_b0 run at --img-size (trained here if missing)")
    ap.add_argument("--img-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2, help="dense training epochs (only if --base is missing)")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--finetune-epochs", type=int, default=1, help="per trial (0: zero-shot)")
    ap.add_argument("--train-images", type=int, default=800)
    ap.add_argument("--eval-images", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--sampler", default="nsga2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--study", default="mgvit_h_study")
    ap.add_argument("--storage", default=None, help="default: a fresh sqlite file under --runs")
    ap.add_argument("--runs", default=str(ROOT / "runs"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    runs = Path(args.runs)
    res = {**header(), "budget": vars(args)}
    base = Path(args.base) if args.base else runs / f"bench_mgvith_dense{args.img_size}"
    dense_base(
        base,
        DataConfig(train_limit=args.train_images, eval_limit=args.eval_images),
        res,
        img_size=args.img_size,
        epochs=args.epochs,
        reuse=True,
    )
    storage = args.storage
    if storage is None:
        db = runs / f"{args.study}.db"
        db.unlink(missing_ok=True)  # a fresh study: the figures are this run's
        storage = f"sqlite:///{db}"
    job = SearchJob(
        base=str(base),
        space=str(SPACE),
        study=args.study,
        storage=storage,
        trials=args.trials,
        finetune_epochs=args.finetune_epochs,
        train_images=args.train_images,
        eval_images=args.eval_images,
        batch_size=args.batch_size,
        sampler=args.sampler,
        seed=args.seed,
    )
    summary = run_search(job, progress=True)
    res["search_s"] = time.time() - t_start
    study = load_study(args.study, storage)[1]
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    res["trials"] = [trial_row(t) for t in done]
    res["failed"] = [
        {"trial": t.number, "state": t.state.name, "params": dict(t.params)}
        for t in study.trials
        if t.state != optuna.trial.TrialState.COMPLETE
    ]
    space = load_space(SPACE)
    names = [f"{m.name}.{p.name}" for m in space.methods for p in m.params]
    coverage = {n: sorted({t.params[n] for t in done if n in t.params}, key=str) for n in names}
    res["coverage"] = {
        "parameters": names,
        "values": coverage,
        "every_parameter_sampled": all(coverage[n] for n in names),
        "every_parameter_varied": all(len(coverage[n]) > 1 for n in names),
    }
    # the dense base on the same validation subset the trials are scored on (FLOPs ratio 1)
    ctx = TrialContext(job)
    res["dense_on_the_same_subset"] = {
        "accuracy": ctx.accuracy(ctx.base),
        "flops_ratio": 1.0,
        "mflops": ctx.dense_flops / 1e6,
    }
    shown = show_study(args.study, storage)
    res["front"] = {
        "kind": shown.kind,
        "scoring": shown.scoring,
        "trials": [
            {
                "trial": r.number,
                "values": dict(r.values),
                "params": dict(r.params),
                "flops_ratio": r.record.flops_ratio,
            }
            for r in shown.trials
        ],
    }
    res["summary"] = {k: v for k, v in summary.to_dict().items() if k in ("complete", "enqueued")}
    res["total_s"] = time.time() - t_start
    save(args.out, res)
    print(
        f"{len(done)} trials, every parameter sampled: {res['coverage']['every_parameter_sampled']}, "
        f"front: {[r['trial'] for r in res['front']['trials']]}",
        flush=True,
    )


if __name__ == "__main__":
    main()
