"""Wall-clock time of each README command on this machine's CPU, run as a user runs them (the CLI in
a fresh process each, import time included), on Fashion-MNIST with the README's default model.

The README's examples train for epochs on 54,000 images; to fit minutes this bench runs each command
on a class-stratified subset (``--train-limit``, ``--eval-limit``) for ``--epochs`` epochs and records
those settings beside the times (a full-size run processes more images: scale the training
commands' times by the images per epoch and the epochs, roughly). The chain is the README's:
train -> evaluate -> profile -> search dcs -> materialize -> retrain -> finetune (EViT) -> export (ONNX).

    python bench/command_times.py                       # reduced defaults (about 5-10 minutes on 2 cores)
    python bench/command_times.py --train-limit 54000 --eval-limit 10000 --epochs 8   # full size (hours)

Writes bench/results/command_times.json (``--out`` for another file). The machine's 1-minute load
average is recorded at the start and after each command: on a shared machine other jobs slow every
command, and the times are only comparable at a similar load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, header, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (OMP_NUM_THREADS)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "command_times.json")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nc-times-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads), NASCOMPRESS_PROGRESS="off")
    limits = ["--train-limit", str(args.train_limit), "--eval-limit", str(args.eval_limit)]
    ep = ["--epochs", str(args.epochs)]
    base, sup, mat, ret, evit = (str(work / n) for n in ("base", "dcs", "dcs-small", "final", "evit"))
    chain = [
        ("train", ["train", "--out", base, *ep, *limits]),
        ("evaluate", ["evaluate", base, "--eval-limit", str(args.eval_limit)]),
        ("profile", ["profile", base, "--compare", base]),
        ("search dcs", ["search", "dcs", base, "--out", sup, "--target-flops", "0.7", *ep, *limits]),
        ("materialize", ["materialize", sup, "--out", mat]),
        ("retrain", ["retrain", mat, "--out", ret, *ep, *limits]),
        ("finetune evit", ["finetune", base, "--method", "evit", "--keep-rate", "0.7", "--out", evit, *ep, *limits]),
        ("export onnx", ["export", ret, "--out", str(work / "model.onnx")]),
    ]
    rows = []
    load0 = round(os.getloadavg()[0], 1)  # a shared machine: other jobs' load slows every command
    try:
        for name, cli in chain:
            t0 = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-m", "nascompress.cli.main", *cli], capture_output=True, text=True, env=env, cwd=work
            )
            seconds = time.perf_counter() - t0
            if r.returncode != 0:
                raise SystemExit(f"{name} failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
            rows.append(
                {
                    "cli": "nascompress "
                    + " ".join(c if not c.startswith(str(work)) else c.replace(str(work), "RUNS") for c in cli),
                    "name": name,
                    "seconds": round(seconds, 1),
                    "load_avg_1min_after": round(os.getloadavg()[0], 1),
                }
            )
            print(f"{name}: {seconds:.1f} s", flush=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import nascompress.cli.main"], check=True, env=env)
        startup = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = header()
    info["machine"].update(cpu_threads=args.threads, load_average_at_start=load0)  # (the commands' threads)
    res = {
        **info,
        "dataset": "fashion-mnist",
        "model": "the default custom ViT (28 px, width 96, depth 6, 3 heads)",
        "train_limit": args.train_limit,
        "eval_limit": args.eval_limit,
        "epochs": args.epochs,
        "cli_startup_s": round(startup, 1),
        "commands": rows,
        "note": "each command in a fresh process (start-up included), on train_limit training images for epochs "
        "epochs and eval_limit validation and test images",
    }
    save(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
