"""Data-parallel step time on CPU: the main job's dense model trained by ``nascompress train`` under
``torchrun --nproc-per-node 2`` (gloo, one thread per process), this checkout against another one
(e.g. the commit before a change to :mod:`nascompress.train.distributed`), interleaved round by round.

    python bench/ddp_cpu.py --before-root ../old-checkout --rounds 3 --train-limit 6400

Each run trains one epoch of Fashion-MNIST (``--train-limit`` training images, a global batch of 128: 64 per
process) and reads the epoch's training time from its ``log.jsonl`` (data loading included,
validation not); a step is that time over the epoch's steps. The figures are medians over the
rounds. Writes ``bench/results/ddp_cpu.json`` (the checkouts are named by their git commit, not
their path).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, header

# the main job's dense base (configs/fashion-mnist.yaml): custom ViT 28x28, patch 4, width 96, depth 6, 3 heads
MODEL = [
    "--img-size",
    "28",
    "--patch-size",
    "4",
    "--embed-dim",
    "96",
    "--depth",
    "6",
    "--num-heads",
    "3",
    "--in-chans",
    "1",
]
PROCS, GLOBAL_BATCH = 2, 128


def commit(root: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    return out.stdout.strip() + ("+changes" if dirty else "")


def one_run(root: Path, out: Path, *, train_limit: int, procs: int) -> dict:
    """One epoch of ``nascompress train`` from ``root``'s code in ``procs`` processes; its timing."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
        if procs > 1
        else [sys.executable]
    )
    cli = (
        "nascompress.cli.main" if (root / "nascompress" / "cli" / "main.py").is_file() else "cli.main"
    )  # older checkouts
    cmd = [
        *launch,
        "-m",
        cli,
        "train",
        "--out",
        str(out),
        *MODEL,
        "--dataset",
        "fashion-mnist",
        "--train-limit",
        str(train_limit),
        "--eval-limit",
        "256",
        "--epochs",
        "1",
        "--batch-size",
        str(GLOBAL_BATCH // procs),
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        "--num-workers",
        "0",
    ]
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"the run from {root.name} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    rec = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines() if ln][-1]
    steps = -(-train_limit // GLOBAL_BATCH)  # the limit applies to the training split; the last batch may be short
    return {
        "epoch_time_s": rec["epoch_time_s"],
        "steps": steps,
        "step_ms": 1000 * rec["epoch_time_s"] / steps,
        "train_loss": rec.get("train_ce"),
        "val_top1": rec["val_top1"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-root", type=Path, required=True, help="another checkout of the repository (the baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-limit", type=int, default=6400)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ddp_cpu.json")
    args = ap.parse_args()
    roots = {"before": args.before_root.resolve(), "after": ROOT}
    runs: dict[str, list[dict]] = {k: [] for k in roots}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, root in roots.items() if r % 2 == 0 else reversed(roots.items()):
                runs[name].append(one_run(root, Path(tmp) / f"{name}{r}", train_limit=args.train_limit, procs=PROCS))
                print(name, r, runs[name][-1], flush=True)
    med = {k: statistics.median(x["step_ms"] for x in v) for k, v in runs.items()}
    head = header()  # the baseline checkout's path is this machine's: the command names its commit instead
    head["command"] = head["command"].replace(
        shlex.quote(str(args.before_root)), f"<checkout of {commit(roots['before'])}>"
    )
    result = {
        **head,
        "what": f"step time of the main job's dense model, {PROCS} gloo processes x batch "
        f"{GLOBAL_BATCH // PROCS} (global {GLOBAL_BATCH}), 1 thread each, one epoch of "
        f"{args.train_limit} Fashion-MNIST training images, medians of "
        f"{args.rounds} interleaved rounds",
        "commits": {k: commit(v) for k, v in roots.items()},
        "step_ms": med,
        "after_over_before": med["after"] / med["before"],
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(args.out)
    print(json.dumps({k: result[k] for k in ("commits", "step_ms", "after_over_before")}))


if __name__ == "__main__":
    main()
