"""Channel compression of a real pretrained ViT with the data a user actually has (issue 24's bench).

Protocol: the DINOv2 ViT-S/14 backbone as a timm ``vit_small_patch14_dinov2`` state dict at 112 px
(``--weights``, default ``weights/dinov2_vits14_112.safetensors``: made offline by
``python tools/convert_dinov2.py --size 112``, never downloaded)
on Fashion-MNIST resized to 112 px, 3 channels (65 tokens), ``--train-limit`` class-balanced
training images (default 2,000), ``--eval-limit`` class-balanced validation and test images (a
held-out 10% of the training split, and the test split). Per seed:

* ``dense``: the backbone + a linear-probe head (``train --linear-probe``): the base;
* ``dense_ft``: that model fine-tuned with the library's ``retrain`` defaults and budget
  (``--retrain-epochs``; teacher = the dense model, batch and feature distillation by the
  library's rules) with compression off (``uniform`` at keep 1: the plain model): the reference;
* ``uniform@T``: magnitude pruning of every block's MLP hidden neurons and Q/K channels to the
  FLOPs ratio T (``methods.uniform``, ``keep_for_flops``), then the same retraining;
* ``dcs-hidden@T`` / ``dcs-residual@T``: ``search dcs`` at the target T with the library's defaults
  (only the gate family fixed), ``materialize``, then the same retraining; the family the default
  (``auto``) would choose is recorded from its probe.

Every figure is measured on validation (choices) and test (reported) top-1 of the best-validation
checkpoint; FLOPs by the profiler (attention matmuls included). Nothing is tuned per run. Each unit
(``--units``, in order) is a run directory under ``--runs`` and is skipped when finished, so the
bench resumes; the JSON (``--out``) is merged under a lock after every unit, so several bench
processes (``--threads 1`` each on a shared machine) can fill it. Token methods (``evit``,
``dynamicvit``, ``sparsifiner``: zero-shot and fine-tuned with their default recipes, ``--epochs``)
are units too.

    python bench/pretrained.py --runs runs/pretrained_small --seeds 0 --threads 1 \
        --units dense_ft,dcs-hidden@0.7,uniform@0.7,dcs-hidden@0.6,uniform@0.6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from _common import header  # noqa: E402  (puts the repository on sys.path)
import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from _pretrained import TOKEN_METHODS, Bench  # noqa: E402  (the units, shared with dcs_generalise)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--weights",
        default="weights/dinov2_vits14_112.safetensors",
        help="the DINOv2 ViT-S/14 backbone as a timm state dict at 112 px (tools/convert_dinov2.py --size 112)",
    )
    ap.add_argument("--runs", default="runs/pretrained_small")
    ap.add_argument("--out", default="bench/results/pretrained_small_data.json")
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=1000)
    ap.add_argument("--seeds", default="0")
    ap.add_argument(
        "--units",
        default="dense_ft,dcs-hidden@0.7,uniform@0.7,dcs-hidden@0.6,uniform@0.6,dcs-residual@0.7,dcs-residual@0.6",
        help="in order: dense_ft, uniform@T, dcs-hidden@T, dcs-residual@T (T a FLOPs target), "
        f"and token methods {', '.join(TOKEN_METHODS)}",
    )
    ap.add_argument("--summary-targets", default="0.7,0.6", help="the targets the summary compares")
    ap.add_argument("--retrain-epochs", type=int, default=3, help="the retraining budget of every model")
    ap.add_argument("--epochs", type=int, default=1, help="token methods' fine-tune epochs")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (1 on a shared machine: several 2-thread processes on 2 cores stall each other)",
    )
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX folder (default: the Debian package's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    a.summary_targets = [float(t) for t in a.summary_targets.split(",")]
    out = Path(a.out)
    res: dict[str, Any] = dict(header())
    res["protocol"] = {
        "model": "vit_small_patch14_dinov2 (DINOv2 ViT-S/14 backbone), 112 px, 65 tokens",
        "weights": Path(a.weights).name,
        "dataset": "fashion-mnist",
        "train_images": a.train_limit,
        "eval_images": a.eval_limit,
        "retrain_epochs": a.retrain_epochs,
        "defaults": "library defaults for search dcs and retrain (auto batch, feature KD with the "
        "dense teacher); only the gate family is fixed per DCS run",
    }
    units = a.units.split(",")
    for seed in [int(s) for s in a.seeds.split(",")]:
        b = Bench(a, seed, res, out)
        b.ensure_dense()
        for u in units:
            name, _, t = u.partition("@")
            if name == "dense_ft":
                b.dense_ft()
            elif name == "uniform":
                b.uniform(float(t))
            elif name.startswith("dcs-"):
                b.family_probe(float(t))
                b.dcs(name[4:], float(t))
            elif name in TOKEN_METHODS:
                b.token(name)
            else:
                raise SystemExit(f"unknown unit {u!r}")
    print(json.dumps(json.loads(out.read_text()).get("summary"), indent=1))


if __name__ == "__main__":
    main()
