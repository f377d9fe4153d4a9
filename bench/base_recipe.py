"""Fewer passes for the main job's dense base (issue 67: the base training is most of the main job's
time): does a shorter recipe with a larger peak learning rate reach the recipe's dense accuracy?

Each variant is the base of ``configs/fashion-mnist.yaml`` (custom ViT 28 px, patch 4, width 96, depth
6, 3 heads, batch 128, ``amp: auto``, seed 0, Fashion-MNIST with 10% of train held out for validation)
trained by ``nascompress train`` as a user runs it, one after the other on this machine (nothing else
should run beside it: the wall times are the point), with only ``--epochs`` and ``--lr`` changed. Each
row: the command's wall time, the training's own time, the best validation top-1 (what a choice between
recipes may look at) and the test top-1 on the 10,000 test images (reported, never chosen on).

    python bench/base_recipe.py                        # the recipe and two shorter ones: ~12 min (AMD EPYC, 2 cores)
    python bench/base_recipe.py --variants 8:1e-3 6:1.5e-3 --out base_recipe_try.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, header, load, save, slug  # noqa: E402  (puts the repository on sys.path)
from _cpu import cpu_info  # noqa: E402

from nascompress.runs.json_io import read_json  # noqa: E402

RECIPE = (8, 1e-3)  # configs/fashion-mnist.yaml's base: epochs, peak lr
MODEL = [
    "--img-size", "28", "--patch-size", "4", "--embed-dim", "96", "--depth", "6", "--num-heads", "3",
    "--in-chans", "1", "--batch-size", "128", "--dataset", "fashion-mnist", "--seed", "0",
]  # fmt: skip


def variant(text: str) -> tuple[int, float]:
    """``EPOCHS:LR`` (``6:1.5e-3``)."""
    epochs, lr = text.split(":")
    return int(epochs), float(lr)


def train(epochs: int, lr: float, out: Path, threads: int) -> dict:
    """One ``nascompress train`` run into ``out`` (replaced), timed; its metrics.json figures."""
    env = dict(os.environ, NASCOMPRESS_PROGRESS="plain", PYTHONPATH=str(ROOT))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "nascompress.cli.main", "train", *MODEL, "--epochs", str(epochs), "--lr", str(lr)]
    cmd += ["--out", str(out), "--force"]
    load_before, t0 = load(), time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    m = read_json(out / "metrics.json")
    return {
        "epochs": epochs,
        "lr": lr,
        "wall_s": wall,
        "train_time_s": m.get("train_time_s"),
        "best_val_top1": m.get("best_val_top1"),
        "best_epoch": m.get("best_epoch"),
        "test_top1": m.get("test_top1"),
        "amp": m.get("amp"),
        "load_before": load_before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", type=variant, default=[RECIPE, (6, 1.5e-3), (5, 2e-3)])
    ap.add_argument("--runs", default="runs/base_recipe", help="where the runs are written (replaced)")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the runs (0: as set)")
    ap.add_argument("--out", default=None, help="default: bench/results/base_recipe_<cpu class>.json")
    a = ap.parse_args()
    cpu = cpu_info()
    out = a.out or f"bench/results/base_recipe_{slug(cpu.get('cpu_class', 'cpu'))}.json"
    res = {**header(), **cpu, "recipe": {"epochs": RECIPE[0], "lr": RECIPE[1]}, "rows": []}
    for epochs, lr in a.variants:
        row = train(epochs, lr, Path(a.runs) / f"e{epochs}_lr{lr:g}", a.threads)
        res["rows"].append(row)
        print(f"{epochs} epochs, lr {lr:g}: {row['wall_s']:.0f} s, val {row['best_val_top1']:.2f}%, "
              f"test {row['test_top1']:.2f}%", flush=True)  # fmt: skip
        save(out, res)
    ref = next((r for r in res["rows"] if (r["epochs"], r["lr"]) == RECIPE), None)
    if ref is not None:
        for r in res["rows"]:
            r["time_vs_recipe"] = r["wall_s"] / ref["wall_s"]
            r["val_vs_recipe"] = r["best_val_top1"] - ref["best_val_top1"]
            r["test_vs_recipe"] = r["test_top1"] - ref["test_top1"]
    save(out, res)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
