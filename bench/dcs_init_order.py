"""Which order should the DCS gates start in? Zero-shot accuracy after dropping each block's least
important MLP residual channels, by weight magnitude and by measured activations.

For every fraction f in ``--drop``, every block's MLP keeps its ``1 - f`` most important residual
channels (``methods.dcs.slice_mlp``, the materialized DCS block), ranked by

* ``weight``: ``methods.dcs.channel_importance`` (|LN2 gain| x ||fc1 column|| x ||fc2 row||), the
  gate start of the former default;
* ``activation``: ``methods.dcs.activation_importance`` on ``--calib-images`` training images;

and is evaluated on ``--eval-images`` validation images (a seeded shuffle of the run's validation
split). Also written: the KLs that ``search dcs --init-importance auto`` compares (on the same
calibration draw as the search, ``dcs_search.search.calibration_images``) and the order it picks.

    python bench/dcs_init_order.py --run runs/pretrained/dense --out bench/results/dcs_init_order_dinov2.json
    python bench/dcs_init_order.py --run runs/base --out bench/results/dcs_init_order_fmnist.json
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from _common import header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import InputSpec, load_data, make_loader, preprocess  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.methods.dcs_importance import activation_importance, channel_importance
from nascompress.methods.dcs_materialize import slice_mlp  # noqa: E402
from nascompress.dcs_search.prepare import calibration_images, init_importance  # noqa: E402


@torch.no_grad()
def accuracy(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    hit = sum(int((model(x).argmax(-1) == y).sum()) for x, y in batches)
    return 100.0 * hit / sum(len(y) for _, y in batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a dense run (train / import)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--drop", default="0.2,0.4", help="comma list of the share of residual channels each MLP drops")
    ap.add_argument("--calib-images", type=int, default=256)
    ap.add_argument("--eval-images", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, arch = load_with_arch(a.run)
    model.eval()
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(run_data_config(a.run), spec=spec)
    calib = calibration_images(data, spec, n=a.calib_images, seed=a.seed)
    val, n = [], 0
    for imgs, y in make_loader(data.val, batch_size=100, shuffle=True, seed=a.seed + 1):
        val.append((preprocess(imgs, spec)[: a.eval_images - n], y[: a.eval_images - n]))
        n += len(val[-1][1])
        if n >= a.eval_images:
            break
    t0 = time.time()
    orders = {
        "weight": [channel_importance(b).residual for b in model.blocks],
        "activation": [ci.residual for ci in activation_importance(model, calib)],
    }
    _, auto = init_importance(model, calib, "auto")
    res = {
        **header(),
        "run": str(a.run),
        "eval_images": n,
        "calib_images": a.calib_images,
        "dense_val_top1": accuracy(model, val),
        "auto": auto.to_dict(),
        "rows": [],
    }
    for f in [float(v) for v in a.drop.split(",")]:
        for name, imp in orders.items():
            m = copy.deepcopy(model)
            for blk, score in zip(m.blocks, imp):
                k = max(1, round((1 - f) * score.numel()))
                slice_mlp(blk, score.topk(k).indices.sort().values)
            res["rows"].append({"drop": f, "order": name, "val_top1": accuracy(m, val)})
            print(res["rows"][-1], flush=True)
    res["wall_s"] = time.time() - t0
    save(Path(a.out), res)


if __name__ == "__main__":
    main()
