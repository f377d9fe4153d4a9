"""Why does a DCS search on a pretrained probe dip so deep while its target ramps down, and which
setting makes it dip less? (issue: a compression search that never gives a user less than the
simplest alternative.)

On a DINOv2 ViT-S/14 linear probe, validation top-1 falls by 15-30 points in the first epoch of the
search (the moving target reaches 0.8x there) and comes back over the last two epochs, at the final
architecture. This bench runs the user's command, ``nascompress search dcs BASE --target-flops T
--epochs 4 --max-val-drop 100`` (run to its end, so every variant is measured whole), once per
variant (``--variants``: ``NAME`` from :data:`VARIANTS`, each the default command plus a few options:
the candidates the issue names that the command exposes), per base (``--bases``: ``DATASET=RUN``, a
probe trained with ``train --linear-probe`` on that dataset). Per run: validation top-1 of the
dense model, after every epoch (in its hard-masked state: the architecture at that epoch's moving
target), the dip (lowest epoch minus dense), the final validation and test top-1, where it landed,
and which model the in-search baseline comparison kept and by how much. Each search is a run
directory under ``--runs``, skipped when finished, so the bench resumes.

    python bench/dcs_dip.py --bases fmif=runs/probe_fmif --variants default,ramp75,features,weight_order
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import header, log_summary, run_user_search, save  # noqa: E402  (puts the repository on sys.path)
from nascompress.runs.json_io import read_json  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "default": [],
    # the target reaches its end after 3 of the 4 epochs instead of 2: a slower ramp
    "ramp75": ["--target-ramp", "0.75"],
    # distillation on the feature the head reads only, none on the (sharp) logits
    "features": ["--distill", "0"],
    # logits only, no feature distillation
    "logits": ["--feat-distill", "0"],
    # the gates' start ordered by weight magnitude (the magnitude baseline's ranking)
    "weight_order": ["--init-importance", "weight"],
    # no channel protected from closing (the outlier channels of pretrained ViTs included)
    "no_protect": ["--protect-ratio", "0"],
}


def search(a: argparse.Namespace, dataset: str, base: str, variant: str) -> Path:
    out = Path(a.runs) / dataset / f"{variant}_t{a.target:g}_s{a.seed}"
    return run_user_search(base, a.target, a, out, VARIANTS[variant])


def record(out: Path, variant: str) -> dict:
    m = read_json(out / "metrics.json")
    per_epoch = log_summary(out)["val_per_epoch"]
    comp = m.get("comparison") or {}
    dense = m["dense_val_top1"]
    return {
        "variant": variant,
        "options": VARIANTS[variant],
        "amp": m.get("amp"),
        "dense_val_top1": dense,
        "val_per_epoch": per_epoch,
        "dip_pt": min(per_epoch) - dense if per_epoch else None,
        "val_top1": m["val_top1"],
        "test_top1": m.get("test_top1"),
        "flops_ratio": m["flops_ratio"],
        "at_target_share": m.get("at_target_share"),
        "kept": m.get("kept"),
        "in_search_dcs_val": (comp.get("dcs") or {}).get("val_top1"),
        "in_search_magnitude_val": (comp.get("magnitude") or {}).get("val_top1"),
        "search_time_s": m.get("search_time_s"),
        "run": str(out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bases", required=True, help="DATASET=RUN pairs: a linear-probe run per dataset")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each search (default: all)")
    ap.add_argument("--runs", default="runs/dcs_dip")
    ap.add_argument("--out", default="bench/results/dcs_dip.json")
    a = ap.parse_args()
    res = dict(header())
    res["protocol"] = {
        "target_flops": a.target,
        "epochs": 4,
        "train_limit": a.train_limit,
        "eval_limit": a.eval_limit,
        "seed": a.seed,
        "command": "nascompress search dcs BASE --target-flops T --epochs 4 --max-val-drop 100 + the variant's options",
    }
    out = Path(a.out)
    res["bases"] = (read_json(out) if out.is_file() else {}).get("bases", {})
    for pair in a.bases.split(","):
        dataset, _, base = pair.partition("=")
        dense = read_json(Path(base) / "metrics.json")
        rows = {r["variant"]: r for r in res["bases"].get(dataset, {}).get("rows", [])}
        for v in a.variants.split(","):
            if v not in VARIANTS:
                raise SystemExit(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
            rows[v] = record(search(a, dataset, base, v), v)
            res["bases"][dataset] = {
                "run": base,
                "probe_test_top1": dense.get("test_top1"),
                "rows": list(rows.values()),
            }
            save(out, res)
    print(out.read_text())


if __name__ == "__main__":
    main()
