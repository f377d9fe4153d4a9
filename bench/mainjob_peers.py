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

``--match latency`` (issue 65: at equal measured latency, the searched model is at least as accurate as
Torch-Pruning's after the same retraining) matches each structured peer (``torch-pruning``, ``magnitude``)
to the final model's measured batch-1 latency instead of its FLOPs: the peer's pruning amount
(Torch-Pruning's pruning ratio in [0, 0.95]; the magnitude baseline's FLOPs target, which sets its global
threshold) is bisected (:func:`_common.bisect_to_ratio`) to the least-pruned setting whose latency is at
most the final model's (within ``--lat-tol``): as fast, and otherwise pruned as little as it can be.
Each step times [dense base, final model, candidate] interleaved in this process
(:func:`nascompress.profiling.time_models`: medians of rotating rounds; CPU, fp32, batch 1,
``--lat-warmup`` / ``--lat-iters``). The matched peer is timed once more (its reported ratio and
speed-ups vs dense at batch 1 and 64, with the final model's, measured interleaved). A peer that stays
slower than the final model even at its most-pruned setting (Torch-Pruning and the magnitude rule prune
only the MLP hidden neurons, which at batch 1 barely moves the latency of a model this small) is
recorded as ``reached: false`` with the closest ratio and its amount, and is retrained and scored at that
most-pruned setting all the same (``retrained_at`` in its ``match``). The retraining job and the test
top-1 are those of the FLOPs mode; ``plain`` is not a pruned peer and runs as there. The JSON gets a
top-level ``"match": "latency"``, the CPU and torch thread count (``latency``) and a ``match`` per peer:

    python bench/mainjob_peers.py --pipeline runs/latcfg --match latency --out bench/results/mainjob_peers_latency.json

``--epochs`` / ``--train-limit`` / ``--eval-limit`` override the retraining job for smoke runs only
(recorded under ``smoke`` in the JSON; never for a reported result).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402  (puts the repository on sys.path)
    bisect_to_ratio,
    header,
    save,
    torch_pruning_keep,
    torch_pruning_rows,
)
import torch  # noqa: E402

from nascompress.dcs_search.baseline import magnitude_supernet  # noqa: E402
from nascompress.methods.dcs import materialize  # noqa: E402
from nascompress.methods.uniform import uniform_from_keep  # noqa: E402
from nascompress.runs.io import load_with_arch, save_model  # noqa: E402
from nascompress.profiling import count_flops, time_models  # noqa: E402
from nascompress.profiling.latency_table import cpu_info  # noqa: E402
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
    else:
        model, record, info = peer_at(kind, dense, x, target)  # the magnitude baseline at the FLOPs target
    info = dict(info, flops_ratio=count_flops(model, x).total / full)
    _save_run(out, model, arch, record, data, info)
    return info


# --match latency: each structured peer's pruning amount, from its least- to its most-pruned value
LATENCY_KNOBS = {
    "torch-pruning": ("pruning_ratio", 0.0, 0.95),  # Torch-Pruning's ratio (0.95: torch_pruning_keep's bound)
    "magnitude": ("flops_target", 1.0, 0.0),  # magnitude_supernet's target: sets the global threshold
}


def peer_at(kind: str, dense: Any, x: Any, amount: float) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The peer ``kind`` built from ``dense`` at pruning amount ``amount`` (:data:`LATENCY_KNOBS`): (the
    model, its method record, what the build reports)."""
    if kind == "torch-pruning":
        import torch_pruning as tp  # optional: the external peer (pip install torch-pruning==1.6.1)

        model, record = uniform_from_keep(dense, torch_pruning_rows(dense, x, amount))
        info = {"pruning_ratio": amount, "torch_pruning": tp.__version__}
    elif kind == "magnitude":
        sn, cfg, _, baseline = magnitude_supernet(copy.deepcopy(dense), target=amount, align=8, fill=None, x1=x)
        model, record = materialize(sn, cfg)
        info = baseline.to_dict()
    else:
        raise SystemExit(f"unknown peer {kind!r} (peers: {', '.join(LATENCY_KNOBS)}, plain)")
    return model.eval(), record, info


def build_peer_at_latency(kind: str, base: Path, final: Path, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The peer ``kind`` pruned to the final model's measured batch-1 latency (module docstring), saved as
    a run in ``out``; returns what :func:`build_peer` does plus ``match``: the bisection's steps, whether
    the latency was reached, the re-measured ratio and the speed-ups vs dense (batch 1 and 64)."""
    dense, arch = load_with_arch(base)
    dense.eval()
    fin = load_with_arch(final)[0].eval()
    spec = arch["input"]
    shape = (spec["in_chans"], *spec["img_size"])
    x = torch.zeros(1, *shape)  # the FLOPs input, as build_peer's
    g = torch.Generator().manual_seed(0)
    x1, x64 = torch.randn(1, *shape, generator=g), torch.randn(64, *shape, generator=g)
    full = count_flops(dense, x).total
    data = read_json(base / "config.json").get("data")
    knob, least, most = LATENCY_KNOBS[kind]

    def timed(model: Any, xb: Any, warmup: int, iters: int) -> dict[str, float]:
        t_dense, t_final, t_peer = time_models([dense, fin, model], xb, warmup=warmup, iters=iters)
        return {
            "ratio": t_peer / t_final,  # the peer's latency over the final model's
            "dense_ms": t_dense * 1e3,
            "final_ms": t_final * 1e3,
            "peer_ms": t_peer * 1e3,
            "final_speedup": t_dense / t_final,
            "peer_speedup": t_dense / t_peer,
        }

    def measure(amount: float) -> dict[str, float]:
        model = peer_at(kind, dense, x, amount)[0]
        got = timed(model, x1, a.lat_warmup, a.lat_iters)
        got["flops_ratio"] = count_flops(model, x).total / full
        print(f"{kind}: {knob} {amount:.4f} -> latency {got['ratio']:.3f}x the final model's", flush=True)
        return got

    found = bisect_to_ratio(measure, least, most, target=1.0, tol=a.lat_tol, steps=a.lat_steps)
    model, record, info = peer_at(kind, dense, x, found["amount"])
    info = dict(info, **{knob: found["amount"]})  # (Torch-Pruning's info has its ratio already)
    b1 = timed(model, x1, a.lat_warmup, a.lat_iters)  # the chosen setting, measured a second time
    b64 = timed(model, x64, max(1, a.lat_warmup // 2), a.lat_iters_64)
    flops_ratio = count_flops(model, x).total / full
    match = {
        "on": "batch-1 latency, peer / final model (medians of interleaved rounds with the dense base)",
        "device": "cpu",
        "dtype": "fp32",
        "knob": knob,
        "least_pruned": least,
        "most_pruned": most,
        "target_ratio": 1.0,
        "tol": a.lat_tol,
        "reached": found["reached"],
        "reachable": found["reachable"],
        knob: found["amount"],
        "ratio_in_search": found["ratio"],
        "ratio_remeasured": b1["ratio"],
        "retrained_at": (
            "the least-pruned setting as fast as the final model"
            if found["reached"]
            else "the most-pruned setting: even there the peer is slower than the final model"
        ),
        "flops_ratio": flops_ratio,
        "final_flops_ratio": count_flops(fin, x).total / full,
        "speedup_batch1": {"peer": b1["peer_speedup"], "final": b1["final_speedup"]},
        "speedup_batch64": {"peer": b64["peer_speedup"], "final": b64["final_speedup"]},
        "batch1_ms": {k: b1[k] for k in ("dense_ms", "final_ms", "peer_ms")},
        "batch64_ms": {k: b64[k] for k in ("dense_ms", "final_ms", "peer_ms")},
        "steps": found["steps"],
    }
    info = dict(info, flops_ratio=flops_ratio)
    _save_run(out, model, arch, record, data, info)
    return dict(info, match=match)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="runs/demo", help="a finished pipeline run (the README main job's --out)")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--match", choices=("flops", "latency"), default="flops", help="what the peers are matched on")
    ap.add_argument("--target", type=float, default=None, help="FLOPs ratio (default: the final model's)")
    ap.add_argument("--runs", default=None, help="default runs/mainjob_peers (latency: runs/mainjob_peers_latency)")
    ap.add_argument(
        "--out",
        default=None,
        help="default bench/results/mainjob_peers.json (latency: bench/results/mainjob_peers_latency.json)",
    )
    ap.add_argument("--lat-tol", type=float, default=0.03, help="latency match: relative tolerance on the ratio")
    ap.add_argument("--lat-steps", type=int, default=8, help="latency match: bisection steps at most")
    ap.add_argument("--lat-warmup", type=int, default=10, help="latency match: warm-up forwards per model")
    ap.add_argument("--lat-iters", type=int, default=200, help="latency match: timed rounds at batch 1")
    ap.add_argument("--lat-iters-64", type=int, default=30, help="latency match: timed rounds at batch 64")
    ap.add_argument("--epochs", type=int, default=None, help="SMOKE ONLY: override the retraining job's epochs")
    ap.add_argument("--train-limit", type=int, default=None, help="SMOKE ONLY: override its training images")
    ap.add_argument("--eval-limit", type=int, default=None, help="SMOKE ONLY: override its val/test images")
    a = ap.parse_args()
    latency = a.match == "latency"
    if latency and a.target is not None:
        raise SystemExit("--target is the FLOPs match's; --match latency matches the final model's latency")
    a.runs = a.runs or ("runs/mainjob_peers_latency" if latency else "runs/mainjob_peers")
    a.out = a.out or ("bench/results/mainjob_peers_latency.json" if latency else "bench/results/mainjob_peers.json")
    pipe, runs = Path(a.pipeline), Path(a.runs)
    base, final = pipe / "base", pipe / "final"
    summary = read_json(pipe / "summary.json")
    target = a.target or summary["final"]["macs"] / summary["dense"]["macs"]
    names = {f.name for f in dataclasses.fields(RetrainJob)}  # config.json also holds what the run derived
    job = RetrainJob.from_dict({k: v for k, v in read_json(final / "config.json").items() if k in names})
    smoke = {k: v for k, v in (("epochs", a.epochs), ("train_limit", a.train_limit), ("eval_limit", a.eval_limit)) if v}
    if smoke:  # a shortened job: proves the code path, reports nothing
        if job.data is None and (a.train_limit or a.eval_limit):
            raise SystemExit("--train-limit / --eval-limit: the final model's job names no data")
        lim = {k: v for k, v in smoke.items() if k != "epochs"}
        job = job.replace(
            train=dataclasses.replace(job.train, epochs=a.epochs) if a.epochs else job.train,
            data=dataclasses.replace(job.data, **lim) if lim else job.data,
        )
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
    if smoke:
        res["smoke"] = dict(smoke, note="SMOKE RUN: the retraining job was shortened; not a result")
    if latency:
        res["match"] = "latency"
        res["latency"] = {
            "cpu": cpu_info()[0],
            "torch_threads": torch.get_num_threads(),
            "device": "cpu",
            "dtype": "fp32",
            "warmup": a.lat_warmup,
            "iters_batch1": a.lat_iters,
            "iters_batch64": a.lat_iters_64,
            "tol": a.lat_tol,
            "max_steps": a.lat_steps,
        }
    if Path(a.out).is_file():  # the peers of an earlier run of this bench on the same pipeline run are kept
        old = read_json(Path(a.out))
        same = old.get("match", "flops") == a.match and old.get("smoke") == res.get("smoke")
        if old.get("main_job") == res["main_job"] and same:
            res.update({k: v for k, v in old.items() if k in PEERS})
    for kind in a.peers.split(","):
        pruned, rt = runs / kind, runs / f"{kind}_retrained"
        t0 = time.time()
        match = None
        if kind == "plain":  # the same picked model and job, cross-entropy only
            picked = pipe / "tokens" / "picked"
            if not picked.is_dir():  # a pipeline without a token stage: the model the final retraining started from
                picked = Path(job.model_dir)
            info = {"model": str(picked), "flops_ratio": read_json(picked / "metrics.json").get("flops_ratio")}
            if latency:
                match = {"note": "not a pruned peer: the model the pipeline retrained, as in --match flops"}
            plain = job.replace(teacher=None, retrain=job.retrain.replace(feat_kd=0.0, eta=0.0))
            retrain(plain.replace(model_dir=str(picked), out=str(rt)), force=True)
        else:
            if latency:
                info = build_peer_at_latency(kind, base, final, pruned, a)
                match = info.pop("match")
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
        if match is not None:
            res[kind]["match"] = match
        save(a.out, res)
    print({k: res[k]["test_top1"] for k in a.peers.split(",")}, "main job", res["main_job"])


if __name__ == "__main__":
    main()
