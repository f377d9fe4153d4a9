"""The main job against what a user gets for free, on the same base, at the same FLOPs, with the same
retraining budget (issue: a compression search that never gives less than the simplest alternative).

Reads a finished ``nascompress pipeline`` run (``--pipeline``, default ``runs/demo``: the README's main
job): its dense base (``base/``), its final model (``final/``) and the retraining job that made it
(``final/config.json``: epochs, lr, images, teacher). For each peer it builds the model at the final
model's FLOPs ratio (or ``--target``), retrains it with that same job, and scores it on the test split:

- ``torch-pruning``: Torch-Pruning 1.6.1 (``pip install torch-pruning==1.6.1``), ``MetaPruner`` with its
  group L2 magnitude importance, global pruning of the MLP hidden neurons, ``round_to`` 8, its pruning
  ratio bisected to the FLOPs target (:func:`_common.torch_pruning_keep`);
- ``magnitude``: the library's in-search baseline (:func:`nascompress.dcs_search.baseline.magnitude_supernet`:
  the same rule, mean-normalized per block, with the bias correction of the closed neurons);
- ``plain``: not a peer but the main job's own retraining recipe against plain fine-tuning: the
  model the pipeline picked (``tokens/picked/``, before its retraining) fine-tuned with the same job
  but cross-entropy only (no teacher: no logit or feature distillation, no IB bound).

    python bench/mainjob_peers.py --pipeline runs/demo --out bench/results/mainjob_peers.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from pathlib import Path
from typing import Any

from _common import header, save, torch_pruning_keep  # noqa: E402  (puts the repository on sys.path)
import torch  # noqa: E402

from nascompress.dcs_search.baseline import magnitude_supernet  # noqa: E402
from nascompress.methods.dcs import materialize  # noqa: E402
from nascompress.methods.uniform import uniform_from_keep  # noqa: E402
from nascompress.runs.io import load_with_arch, save_model  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.retraining.run import RetrainJob, retrain  # noqa: E402
from nascompress.runs.out_dir import create_out_dir, prepare_out_dir
from nascompress.runs.json_io import read_json, write_json  # noqa: E402


PEERS = ("torch-pruning", "magnitude", "plain")  # the units, in the order they run by default


def _save_run(
    out: Path, model: Any, arch: dict[str, Any], record: dict[str, Any], data: Any, info: dict[str, Any]
) -> None:
    prepare_out_dir(out, force=True)
    create_out_dir(out, force=True)
    save_model(out, model.eval(), dict(copy.deepcopy(arch), methods=[record]))
    write_json(out / "config.json", {"data": data})
    write_json(out / "metrics.json", info)


def build_peer(kind: str, base: Path, target: float, out: Path) -> dict[str, Any]:
    dense, arch = load_with_arch(base)
    dense.eval()
    spec = arch["input"]
    x = torch.zeros(1, spec["in_chans"], *spec["img_size"])
    full = count_flops(dense, x).total
    data = read_json(base / "config.json").get("data")
    if kind == "torch-pruning":
        import torch_pruning as tp  # optional: the external peer (pip install torch-pruning==1.6.1)

        keep, ratio = torch_pruning_keep(dense, x, target)
        model, record = uniform_from_keep(dense, keep)  # the kept neurons as a nascompress model
        info = {"pruning_ratio": ratio, "torch_pruning": tp.__version__}
    elif kind == "magnitude":
        sn, cfg, _, baseline = magnitude_supernet(copy.deepcopy(dense), target=target, align=8, fill=None, x1=x)
        model, record = materialize(sn, cfg)
        info = baseline.to_dict()
    else:
        raise SystemExit(f"unknown peer {kind!r}")
    info = dict(info, flops_ratio=count_flops(model, x).total / full)
    _save_run(out, model, arch, record, data, info)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="runs/demo", help="a finished pipeline run (the README main job's --out)")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--target", type=float, default=None, help="FLOPs ratio (default: the final model's)")
    ap.add_argument("--runs", default="runs/mainjob_peers")
    ap.add_argument("--out", default="bench/results/mainjob_peers.json")
    a = ap.parse_args()
    pipe, runs = Path(a.pipeline), Path(a.runs)
    base, final = pipe / "base", pipe / "final"
    summary = read_json(pipe / "summary.json")
    target = a.target or summary["final"]["macs"] / summary["dense"]["macs"]
    names = {f.name for f in dataclasses.fields(RetrainJob)}  # config.json also holds what the run derived
    job = RetrainJob.from_dict({k: v for k, v in read_json(final / "config.json").items() if k in names})
    res: dict[str, Any] = dict(
        header(),
        pipeline=str(pipe),
        target_flops=target,
        retrain={
            "epochs": job.train.epochs,
            "lr": job.train.lr,
            "teacher": job.teacher,
            "train_limit": job.data.train_limit if job.data else None,
        },
        main_job={
            "dense_test_top1": summary["dense"]["test_top1"],
            "test_top1": summary["final"]["test_top1"],
            "flops_ratio": summary["final"]["macs"] / summary["dense"]["macs"],
        },
    )
    if Path(a.out).is_file():  # the peers of an earlier run of this bench on the same pipeline run are kept
        old = read_json(Path(a.out))
        if old.get("main_job") == res["main_job"]:
            res.update({k: v for k, v in old.items() if k in PEERS})
    for kind in a.peers.split(","):
        pruned, rt = runs / kind, runs / f"{kind}_retrained"
        t0 = time.time()
        if kind == "plain":  # the same picked model and job, cross-entropy only
            picked = pipe / "tokens" / "picked"
            info = {"model": str(picked), "flops_ratio": read_json(picked / "metrics.json").get("flops_ratio")}
            plain = job.replace(teacher=None, retrain=job.retrain.replace(feat_kd=0.0, eta=0.0))
            retrain(plain.replace(model_dir=str(picked), out=str(rt)), force=True)
        else:
            info = build_peer(kind, base, target, pruned)
            retrain(job.replace(model_dir=str(pruned), out=str(rt)), force=True)
        m = read_json(rt / "metrics.json")
        res[kind] = {
            "pruned": info,
            "test_top1": m["test_top1"],
            "best_val_top1": m["best_val_top1"],
            "wall_s": time.time() - t0,
        }
        save(a.out, res)
    print({k: res[k]["test_top1"] for k in a.peers.split(",")}, "main job", res["main_job"])


if __name__ == "__main__":
    main()
