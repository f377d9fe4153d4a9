"""Can a user afford the DCS search? (issue: a 4-epoch search of ViT-S/14 at 112 px on 2,000 images
in <= 10 minutes on 2 CPU cores, progress visible from its first second.)

Runs the user's command, ``nascompress search dcs BASE --target-flops T --epochs 4`` with every other
setting at its default (``--max-val-drop 100`` only, so that the search runs to its end and its
accuracy is measured), as a separate process, and times it from launch to exit (data loading, the
pre-search measurements, the teacher cache and every epoch with its validation). Also recorded: the
time from launch to the first progress line on stderr, each phase's time as the search reports it,
where the search landed (FLOPs ratio, calibration move, at-target share) and its validation/test
top-1 against the dense model's. BASE (``--base``) is the DINOv2 ViT-S/14 linear probe that
``bench/dcs_generalise.py`` makes (``--bases dinov2``). Run it on a quiet machine: a timing.

    python bench/dcs_search_time.py --base runs/dcs_generalise/fashion-mnist/dinov2/seed0/dense --targets 0.6,0.7
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, header, save  # noqa: E402  (puts the repository on sys.path)
from nascompress.utils import read_json  # noqa: E402

GOAL_S = 600.0


def user_command(base: str, target: float, a: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, str]]:
    """The user's ``search dcs BASE --target-flops T --epochs 4`` (``--max-val-drop 100``: run to the end)
    on ``a``'s images and seed, into ``out``, and the environment to run it in (plain progress lines)."""
    cmd = [sys.executable, "-m", "nascompress.cli.main", "search", "dcs", base, "--target-flops", str(target),
           "--epochs", "4", "--train-limit", str(a.train_limit), "--eval-limit", str(a.eval_limit),
           "--seed", str(a.seed), "--max-val-drop", "100", "--out", str(out)]
    return cmd, dict(os.environ, NASCOMPRESS_PROGRESS="plain", PYTHONPATH=str(ROOT))


def one(base: str, target: float, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "search"
        cmd, env = user_command(base, target, a, out)
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        first, lines = None, []
        for line in p.stderr:
            if first is None:
                first = time.perf_counter() - t0
            lines.append(line.rstrip("\n"))
        rc = p.wait()
        wall = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"the search failed (exit {rc}):\n" + "\n".join(lines[-5:]))
        phases = {m.group(1): float(m.group(2)) for m in
                  (re.match(r"(.*): done in ([\d.]+) s$", ln) for ln in lines) if m}
        m = read_json(out / "metrics.json")
        train = read_json(out / "config.json")["train"]
    return {"target_flops": target, "wall_s": wall, "first_progress_line_s": first, "goal_s": GOAL_S,
            "within_goal": wall <= GOAL_S, "phases_s": phases, "epoch_time_s": m["epoch_time_s"],
            "search_time_s": m["search_time_s"], "flops_ratio": m["flops_ratio"],
            "calibration_move": m["calibration_move"], "at_target_share": m["at_target_share"],
            "val_top1": m["val_top1"], "test_top1": m.get("test_top1"), "dense_val_top1": m["dense_val_top1"],
            "mlp_gates": m["mlp_gates"], "batch_size": m["batch_size"], "teacher_cached": m["teacher_cached"],
            "train_images": m["train_images"], "threads": a.threads,
            "base_lr": train["base_lr"], "layer_decay": train["layer_decay"] or 1.0, "peak_lr": m["peak_lr"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/dcs_generalise/fashion-mnist/dinov2/seed0/dense")
    ap.add_argument("--targets", default="0.6,0.7")
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="bench/results/dcs_search_time.json")
    a = ap.parse_args()
    res = dict(header())
    base_metrics = read_json(Path(a.base) / "metrics.json")
    res["base"] = {"run": a.base, "dataset": base_metrics.get("dataset"), "val_top1": base_metrics.get("best_val_top1"),
                   "test_top1": base_metrics.get("test_top1")}
    res["runs"] = [one(a.base, float(t), a) for t in a.targets.split(",")]
    save(a.out, res)
    for r in res["runs"]:
        print(f"target {r['target_flops']}: {r['wall_s']:.0f} s (goal {GOAL_S:.0f} s), first line after "
              f"{r['first_progress_line_s']:.1f} s, landed {r['flops_ratio']:.3f}, val {r['val_top1']:.1f} "
              f"(dense {r['dense_val_top1']:.1f})")


if __name__ == "__main__":
    main()
