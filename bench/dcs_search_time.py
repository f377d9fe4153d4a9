"""Can a user afford the DCS search? (issues: a 4-epoch search of ViT-S/14 at 112 px on 2,000 images
in <= 10 minutes on 2 CPU cores, progress visible from its first second; then <= 4 minutes on 2,000
ImageFolder images, probes included.)

Runs the user's command, ``nascompress search dcs BASE --target-flops T --epochs 4`` with every other
setting at its default (``--max-val-drop 100`` only, so that the search runs to its end and its
accuracy is measured), as a separate process, and times it from launch to exit (data loading, the
pre-search measurements, the teacher cache and every epoch with its validation). Also recorded: the
time from launch to the first progress line on stderr, each phase's time as the search reports it,
where the search landed (FLOPs ratio, calibration move, at-target share) and its validation/test
top-1 against the dense model's. BASE (``--base``) is the DINOv2 ViT-S/14 linear probe that
``bench/dcs_generalise.py`` makes (``--bases dinov2``). Run it on a quiet machine: a timing.

    python bench/dcs_search_time.py --base runs/dcs_generalise/fashion-mnist/dinov2/seed0/dense --targets 0.6,0.7

``--folder DIR``: the base is instead the DINOv2 linear probe (``train --linear-probe``, made once into
``DIR_probe``) on an ImageFolder at DIR: 2,000 train/ and 1,000 val/ images, written once from
Fashion-MNIST's test split (seeded; 28 px grayscale PNGs, the user's case of issue 48), which is the
path the in-memory datasets do not take (PNG decoding, the ImageFolder teacher cache). ``--amps``: the
search's ``--amp`` values to time (each run in turn):

    python bench/dcs_search_time.py --folder runs/fmnist_folder --targets 0.6 --amps auto,off \
        --out bench/results/dcs_search_time_folder.json
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

from _common import ROOT, fashion_mnist_folders, header, save, user_command  # noqa: E402  (puts the repository on sys.path)

from nascompress.runs.json_io import read_json  # noqa: E402

GOAL_S = 600.0  # the in-memory base's goal (its issue); an ImageFolder base's: GOAL_FOLDER_S (issue 50)
GOAL_FOLDER_S = 240.0


def image_folder(root: Path, seed: int = 123) -> None:
    """2,000 train/ and 1,000 val/ PNGs drawn (seeded) from Fashion-MNIST's test split, one folder per class."""
    if not (root / "val").is_dir():
        fashion_mnist_folders([(root, "train", 0, 2000), (root, "val", 2000, 3000)], seed)


def probe_base(folder: Path, weights: str) -> str:
    """The DINOv2 ViT-S/14 112-px linear probe on ``folder`` (the README's recipe), made once."""
    out = folder.with_name(folder.name + "_probe")
    if not (out / "metrics.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "nascompress.cli.main",
                "train",
                "--model",
                "vit_small_patch14_dinov2",
                "--img-size",
                "112",
                "--weights",
                weights,
                "--reset-head",
                "--linear-probe",
                "--dataset",
                str(folder),
                "--out",
                str(out),
                "--force",
            ],
            check=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    return str(out)


def one(base: str, target: float, a: argparse.Namespace, amp: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "search"
        cmd, env = user_command(base, target, a, out, amp)
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
        phases = {
            m.group(1): float(m.group(2)) for m in (re.match(r"(.*): done in ([\d.]+) s$", ln) for ln in lines) if m
        }
        m = read_json(out / "metrics.json")
        train = read_json(out / "config.json")["train"]
    goal = GOAL_FOLDER_S if a.folder else GOAL_S
    return {
        "target_flops": target,
        "amp": amp or "default",
        "precision": m.get("amp"),
        "wall_s": wall,
        "first_progress_line_s": first,
        "goal_s": goal,
        "within_goal": wall <= goal,
        "phases_s": phases,
        "epoch_time_s": m["epoch_time_s"],
        "search_time_s": m["search_time_s"],
        "flops_ratio": m["flops_ratio"],
        "calibration_move": m["calibration_move"],
        "at_target_share": m["at_target_share"],
        "val_top1": m["val_top1"],
        "test_top1": m.get("test_top1"),
        "dense_val_top1": m["dense_val_top1"],
        "mlp_gates": m["mlp_gates"],
        "batch_size": m["batch_size"],
        "teacher_cached": m["teacher_cached"],
        "train_images": m["train_images"],
        "threads": a.threads,
        "base_lr": train["base_lr"],
        "layer_decay": train["layer_decay"] or 1.0,
        "peak_lr": m["peak_lr"],
        "kept": m.get("kept"),
        "comparison_reason": (m.get("comparison") or {}).get("reason"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/dcs_generalise/fashion-mnist/dinov2/seed0/dense")
    ap.add_argument("--targets", default="0.6,0.7")
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="bench/results/dcs_search_time.json")
    ap.add_argument("--folder", default=None, help="an ImageFolder base instead (see the module docstring)")
    ap.add_argument("--weights", default="weights/dinov2_vits14_112.safetensors")
    ap.add_argument(
        "--amps", default="", help="the search's --amp values to time, comma-separated (default: none given)"
    )
    a = ap.parse_args()
    res = dict(header())
    if a.folder:
        image_folder(Path(a.folder))
        a.base = probe_base(Path(a.folder), a.weights)
    base_metrics = read_json(Path(a.base) / "metrics.json")
    res["base"] = {
        "run": a.base,
        "dataset": base_metrics.get("dataset"),
        "val_top1": base_metrics.get("best_val_top1"),
        "test_top1": base_metrics.get("test_top1"),
    }
    res["runs"] = [one(a.base, float(t), a, amp or None) for t in a.targets.split(",") for amp in a.amps.split(",")]
    save(a.out, res)
    for r in res["runs"]:
        print(
            f"target {r['target_flops']} amp {r['amp']}: {r['wall_s']:.0f} s (goal {r['goal_s']:.0f} s), "
            "first line after "
            f"{r['first_progress_line_s']:.1f} s, landed {r['flops_ratio']:.3f}, val {r['val_top1']:.1f} "
            f"(dense {r['dense_val_top1']:.1f})"
        )


if __name__ == "__main__":
    main()
