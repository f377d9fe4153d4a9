"""Which learning rate lets the DCS search's weights follow the cut? (issue: DCS that reaches its target
while it trains and holds on data nobody tuned it to.)

With ``--w-gates hard`` and ``--budget project`` the weight steps train at the architecture the search
ends with for the second half of the search; whether they can recover the channels it closes depends
on their learning rate. This bench runs the user's command, ``nascompress search dcs BASE
--target-flops T --epochs 4 --max-val-drop 100`` (``--max-val-drop 100`` so every search runs to its
end and is measured), once per weight recipe (``--recipes``: ``BASE_LR:LAYER_DECAY`` pairs; the peak
lr is ``BASE_LR x batch / 512``) and target, every other setting at its default, and records per run
the validation top-1 after every epoch, the final validation and test top-1, where the search landed
(FLOPs ratio, calibration move, at-target share) and the dense model's figures. Each search is a run
directory under ``--runs``, skipped when finished, so the bench resumes. ``--reference FILE`` adds the
runs of ``bench/results/dcs_search_time.json`` (the same command with the library defaults of the
time it was measured, recorded there with their recipe) as rows of their own.

    python bench/dcs_search_lr.py --base runs/dcs_generalise/fashion-mnist/dinov2/seed0/dense \\
        --recipes 5e-4:1,1e-3:1,2e-3:1 --targets 0.7,0.6 --threads 1
    python bench/dcs_search_lr.py --cases 5e-4:1@0.7,1e-3:1@0.7,1e-3:1@0.6 --threads 1
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import header, log_summary, run_user_search, save  # noqa: E402  (puts the repository on sys.path)
from nascompress.runs.json_io import read_json  # noqa: E402


def run_dir(a: argparse.Namespace, recipe: str, target: float) -> Path:
    lr, ld = recipe.split(":")
    return Path(a.runs) / f"lr{lr}_ld{ld}_t{target:g}_s{a.seed}"


def search(a: argparse.Namespace, recipe: str, target: float) -> Path:
    lr, ld = recipe.split(":")
    return run_user_search(a.base, target, a, run_dir(a, recipe, target), ["--base-lr", lr, "--layer-decay", ld])


def record(out: Path, recipe: str) -> dict:
    m = read_json(out / "metrics.json")
    per_epoch = log_summary(out)["val_per_epoch"]
    lr, ld = recipe.split(":")
    return {
        "base_lr": float(lr),
        "layer_decay": float(ld),
        "peak_lr": m["peak_lr"],
        "batch_size": m["batch_size"],
        "target_flops": m["target_flops"],
        "flops_ratio": m["flops_ratio"],
        "calibration_move": m["calibration_move"],
        "at_target_share": m["at_target_share"],
        "val_per_epoch": per_epoch,
        "val_top1": m["val_top1"],
        "test_top1": m.get("test_top1"),
        "dense_val_top1": m["dense_val_top1"],
        "search_time_s": m["search_time_s"],
        "run": str(out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/dcs_generalise/fashion-mnist/dinov2/seed0/dense")
    ap.add_argument("--recipes", default="5e-4:1,1e-3:1,2e-3:1", help="BASE_LR:LAYER_DECAY pairs")
    ap.add_argument("--targets", default="0.7,0.6")
    ap.add_argument(
        "--cases",
        help="RECIPE@TARGET pairs instead of every recipe at every target (e.g. 5e-4:1@0.7,1e-3:1@0.7,1e-3:1@0.6)",
    )
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each search (default: all)")
    ap.add_argument("--runs", default="runs/dcs_search_lr")
    ap.add_argument(
        "--reference",
        default="bench/results/dcs_search_time.json",
        help="earlier runs of the same command to add as rows ('' for none)",
    )
    ap.add_argument("--out", default="bench/results/dcs_search_lr.json")
    a = ap.parse_args()
    res = dict(header())
    base = read_json(Path(a.base) / "metrics.json")
    res["base"] = {
        "run": a.base,
        "dataset": base.get("dataset"),
        "val_top1": base.get("best_val_top1"),
        "test_top1": base.get("test_top1"),
        "train_limit": a.train_limit,
        "eval_limit": a.eval_limit,
        "seed": a.seed,
    }
    cases = (
        [tuple(c.split("@")) for c in a.cases.split(",")]
        if a.cases
        else [(r, t) for t in a.targets.split(",") for r in a.recipes.split(",")]
    )
    rows = [record(search(a, r, float(t)), r) for r, t in cases]
    if a.reference and Path(a.reference).is_file():
        ref = read_json(Path(a.reference))
        for r in ref["runs"]:  # runs recorded before that bench kept the recipe were measured with 1e-4 / 0.75
            rows.append(
                {
                    "base_lr": r.get("base_lr", 1e-4),
                    "layer_decay": r.get("layer_decay", 0.75),
                    "target_flops": r["target_flops"],
                    "flops_ratio": r["flops_ratio"],
                    "calibration_move": r["calibration_move"],
                    "at_target_share": r["at_target_share"],
                    "val_top1": r["val_top1"],
                    "test_top1": r["test_top1"],
                    "dense_val_top1": r["dense_val_top1"],
                    "source": a.reference,
                }
            )
    res["rows"] = rows
    best = {}
    for r in rows:  # chosen on validation; test reported beside it
        t = f"{r['target_flops']:g}"
        if t not in best or r["val_top1"] > best[t]["val_top1"]:
            best[t] = r
    res["best_by_val"] = {
        t: {
            "base_lr": r["base_lr"],
            "layer_decay": r["layer_decay"],
            "val_top1": r["val_top1"],
            "test_top1": r["test_top1"],
        }
        for t, r in best.items()
    }
    save(a.out, res)
    for r in rows:
        print(
            f"target {r['target_flops']:g} base_lr {r['base_lr']:g} layer_decay {r['layer_decay']:g}: val "
            f"{r['val_top1']:.1f} test {r['test_top1']:.1f} landed {r['flops_ratio']:.3f} "
            f"(calibration move {r['calibration_move']:.3f})"
        )


if __name__ == "__main__":
    main()
