"""Fine-tuning a pretrained backbone with a new head: from a random head (the recipe before issue 68
item 4) against from a fitted linear-probe head (LP-FT, Kumar et al. 2022, the default now), with
the linear probe itself as the yardstick.

Protocol: the DINOv2 ViT-S/14 backbone as a timm ``vit_small_patch14_dinov2`` state dict at 112 px
(``--weights``, made offline by ``python tools/convert_dinov2.py --size 112``), Fashion-MNIST with
``--train-limit`` training images (its val split carved from them, seeded) and ``--eval-limit``
val/test images, ``--epochs`` epochs of ``nascompress train --weights W --reset-head``'s recipe
(FINE_TUNE_TRAIN), one ``--seed`` for everything. Three runs: ``probe`` (``--linear-probe``),
``random_head`` (``TrainJob(probe_start=False)``: the head starts at random), ``from_probe``
(the default: LP-FT, the probe kept when no fine-tuned epoch beats it on validation) and
``from_probe_low_lr`` (LP-FT at a tenth of the recipe's base lr). Accuracy only:
the machine may be shared, so no timing is claimed.

    OMP_NUM_THREADS=1 python bench/finetune_from_probe.py --seed 0
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import machine, save  # noqa: E402  (puts the repository on sys.path)
from nascompress.data import DataConfig  # noqa: E402
from nascompress.models.build import ModelSpec  # noqa: E402
from nascompress.train.run import TrainJob, build_job, train  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402


# the linear probe; fine-tuning from a random head (before LP-FT); LP-FT as shipped; LP-FT with a
# tenth of the fine-tuning base lr (Kumar et al. fine-tune from the probe at a small lr)
KINDS = ("probe", "random_head", "from_probe", "from_probe_low_lr")


def run(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    """One run of ``kind`` (one of KINDS); returns its figures."""
    out = Path(a.work) / kind
    spec = ModelSpec("vit_small_patch14_dinov2", {"img_size": a.img_size, "num_classes": 10})
    data = DataConfig(dataset="fashion-mnist", train_limit=a.train_limit, eval_limit=a.eval_limit, split_seed=a.seed)
    given = {"epochs": a.epochs, "seed": a.seed, "device": "cpu", "amp": a.amp}
    job = build_job(spec, out, data=data, train=given, weights=a.weights, reset_head=True, linear_probe=kind == "probe")
    if kind == "random_head":
        job = TrainJob.from_dict({**job.to_dict(), "probe_start": False})
    if kind == "from_probe_low_lr":  # LP-FT's fine-tune at a tenth of the recipe's base lr
        job = replace(job, train=job.train.replace(base_lr=job.train.base_lr / 10, min_lr=0.0))
    if not (out / "metrics.json").is_file():
        train(job, force=True)
    m = read_json(out / "metrics.json")
    keys = ("best_val_top1", "best_epoch", "test_top1", "test_n", "probe_val_top1", "fine_tuned_val_top1")
    row = {k: m.get(k) for k in keys}
    row["kept_probe"] = m.get("kept_probe")
    if kind != "probe":
        log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines() if ln.strip()]
        row["val_top1_per_epoch"] = [r.get("val_top1") for r in log]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="weights/dinov2_vits14_112.safetensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--img-size", type=int, default=112)
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--work", default="runs/finetune_from_probe")
    ap.add_argument("--out", default="bench/results/finetune_from_probe.json")
    a = ap.parse_args()
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "work", "weights")}
    rows = {kind: run(kind, a) for kind in KINDS}
    out = Path(a.out)
    result = read_json(out) if out.is_file() else {}
    cells = result.get("cells", {})
    if "runs" in result:  # a file of one cell
        cells[cell_key(result["settings"])] = {"settings": result["settings"], "runs": result["runs"]}
    cells[cell_key(settings)] = {"settings": settings, "runs": rows, "summary": summary(rows)}
    result = {
        "protocol": " ".join(__doc__.split("\n\n")[1].split()),
        "weights": "DINOv2 ViT-S/14 backbone, timm vit_small_patch14_dinov2 at 112 px (tools/convert_dinov2.py)",
        "machine": machine(),
        "shared_machine": "accuracy only; the machine was shared with other work, so no timing is claimed",
        "cells": dict(sorted(cells.items())),
    }
    save(out, result)
    print(json.dumps(summary(rows), indent=1))


def cell_key(settings: dict[str, Any]) -> str:
    """One cell's name: its training images, epochs and seed."""
    return f"train{settings['train_limit']}_ep{settings['epochs']}_seed{settings['seed']}"


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Validation and test top-1 of the runs, and whether each fine-tune ends below the probe."""
    probe = rows["probe"]
    out: dict[str, Any] = {"probe": {"val": probe["best_val_top1"], "test": probe["test_top1"]}}
    for kind in KINDS[1:]:
        r = rows[kind]
        out[kind] = {
            "val": r["best_val_top1"],
            "test": r["test_top1"],
            "below_probe_val": r["best_val_top1"] < probe["best_val_top1"],
            "below_probe_test": r["test_top1"] < probe["test_top1"],
        }
        if kind.startswith("from_probe"):
            out[kind]["kept_probe"] = r["kept_probe"]
            out[kind]["probe_val_as_this_run_measures"] = r["probe_val_top1"]  # under its amp
    return out


if __name__ == "__main__":
    main()
