"""Does the pipeline's "test" figure come from images no decision saw, on a dataset without a test split?
(issue 68: the DINOv2 recipe on a ``train/``+``val/``-only ImageFolder printed its selection split as test.)

Writes an ImageFolder with ``train/`` (2,000) and ``val/`` (1,000) only, and beside it a truly held-out
folder of 1,000 more images of the same classes (``test/`` only), all drawn (seeded, disjoint) from
Fashion-MNIST's test split as 28-px grayscale PNGs. Runs the DINOv2 recipe
(``configs/dinov2-fashion-mnist.yaml``'s stages) with ``data.dataset`` the folder, as a user would:
``nascompress pipeline CONFIG --out OUT``. Then ``nascompress evaluate`` of every model the pipeline
wrote (the probed base, the DCS model, the study picks, the final model, the confirm step's channel-only
model) on the held-out folder. Records the summary's test figure and its ``splits`` record (which images
decided, which measured) beside the held-out figures: an honest test split tests within sampling noise of
the held-out images, and the report says which images it measured.

``--where``: instead, the splits of the README's "where to cut" cells (``bench/dcs_generalise.py``'s
data: each dataset's class selection, 2,000 training and 1,000 evaluation images per seed) as
``load_data`` builds them, and whether any test image is also a validation or training image (the
source split and index of every image compared): those cells' test figures come from images no
decision saw when the validation images are carved from the training split and the test images are
the dataset's own test split.

``--budget`` scales the recipe's epochs and trials down (1 = the shipped recipe); the figures are
accuracies, not times, so other work may share the machine.

    python tools/convert_dinov2.py --size 112      # weights/dinov2_vits14_112.safetensors, once
    python bench/honest_splits.py --runs runs/honest --out bench/results/honest_splits.json
    python bench/honest_splits.py --where --out bench/results/honest_splits_where.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from _common import ROOT, fashion_mnist_folders, header, save  # noqa: E402  (puts the repository on sys.path)
import torch  # noqa: E402

from nascompress.data import DataConfig, load_data  # noqa: E402
from nascompress.data.splits import Subset  # noqa: E402
from nascompress.pipeline.files import read_summary  # noqa: E402
import yaml  # noqa: E402

RECIPE = ROOT / "configs" / "dinov2-fashion-mnist.yaml"
WEIGHTS = ROOT / "weights" / "dinov2_vits14_112.safetensors"


def folders(root: Path, seed: int) -> tuple[Path, Path]:
    """``root/user`` (train/ 2,000, val/ 1,000) and ``root/held_out`` (test/ 1,000), written once."""
    user, held = root / "user", root / "held_out"
    if not ((user / "val").is_dir() and (held / "test").is_dir()):
        parts = [(user, "train", 0, 2000), (user, "val", 2000, 3000), (held, "test", 3000, 4000)]
        fashion_mnist_folders(parts, seed)
    return user, held


def recipe(user: Path, budget: float) -> dict:
    """The shipped DINOv2 recipe on the user's folder: the folder's own sizes (no limits), the weights by
    absolute path, epochs and trials scaled by ``budget``."""
    cfg = yaml.safe_load(RECIPE.read_text())
    cfg["data"] = {"dataset": str(user)}
    cfg["base"]["import"]["weights"] = str(WEIGHTS)
    st = cfg["stages"]
    scale = lambda n: max(1, math.ceil(n * budget))  # noqa: E731
    st["dcs"]["epochs"] = scale(st["dcs"]["epochs"])
    st["tokens"]["trials"] = scale(st["tokens"]["trials"])
    st["retrain"]["epochs"] = scale(st["retrain"]["epochs"])
    return cfg


def cli(*args: str, threads: int, capture: bool = True) -> subprocess.CompletedProcess:
    """A ``nascompress`` command as a user runs it; its progress goes to stderr unless ``capture``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "nascompress.cli.main", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=capture, text=True)


def held_out_scores(out: Path, held: Path, threads: int) -> dict:
    """``evaluate`` of every model the pipeline wrote on the held-out folder's ``test/`` images."""
    scores = {}
    for model in sorted(out.rglob("model.safetensors")):
        run = model.parent
        res = json.loads(
            cli("evaluate", str(run), "--dataset", str(held), "--split", "test", "--json", threads=threads).stdout
        )
        scores[str(run.relative_to(out))] = {"top1": res["top1"], "n": res["n"]}
    return scores


WHERE_DATASETS = ("fashion-mnist", "digits", "lfw-faces", "fashion-mnist:5", "fashion-mnist:5-9")


def _origin(ds) -> set[tuple[int, int]]:
    """(loaded split, index in it) of every image of ``ds``: Subset views mapped down to the loaded split
    (a built-in dataset's training and validation views share theirs)."""
    idx = torch.arange(len(ds))
    while isinstance(ds, Subset):
        idx, ds = ds.indices[idx], ds.base
    return {(id(ds), int(i)) for i in idx}


def where_splits(seeds: list[int]) -> dict:
    """Each where-cell dataset's splits (``bench/dcs_generalise.py``'s DataConfig) and their overlaps."""
    res = {}
    for dataset in WHERE_DATASETS:
        name, _, k = dataset.partition(":")
        lo, _, hi = k.partition("-")
        keep = range(int(lo), int(hi) + 1) if hi else range(int(k)) if k else None
        for seed in seeds:
            cfg = DataConfig(
                dataset=name,
                train_limit=2000,
                eval_limit=1000,
                subset_seed=seed,
                classes=",".join(str(c) for c in keep) if keep else None,
            )
            b = load_data(cfg)
            tr, va, te = (_origin(getattr(b, s)) for s in ("train", "val", "test"))
            res[f"{dataset}/seed{seed}"] = {
                "splits": b.splits.to_dict(),
                "n": {"train": len(b.train), "val": len(b.val), "test": len(b.test)},
                "test_in_val": len(te & va),
                "test_in_train": len(te & tr),
                "val_in_train": len(va & tr),
            }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "honest")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "honest_splits.json")
    ap.add_argument("--seed", type=int, default=123, help="the draw of the folders' images")
    ap.add_argument("--budget", type=float, default=1.0, help="scale of the recipe's epochs and trials")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--where", action="store_true", help="the where-to-cut cells' splits instead")
    ap.add_argument("--seeds", default="0,1,2", help="--where: the cells' seeds")
    a = ap.parse_args()
    if a.where:
        res = {**header(), "where": where_splits([int(s) for s in a.seeds.split(",")])}
        save(a.out, res)
        print(
            json.dumps(
                {
                    k: {f: v[f] for f in ("n", "test_in_val", "test_in_train", "val_in_train")}
                    for k, v in res["where"].items()
                },
                indent=1,
            )
        )
        return
    if not WEIGHTS.is_file():
        sys.exit(f"{WEIGHTS} is missing: run python tools/convert_dinov2.py --size 112 first")
    a.runs = a.runs.resolve()  # the config names the folders by absolute path
    a.runs.mkdir(parents=True, exist_ok=True)
    user, held = folders(a.runs, a.seed)
    cfg_path = a.runs / "config.yaml"
    cfg_path.write_text(json.dumps(recipe(user, a.budget), indent=1))  # JSON is YAML
    out = a.runs / "pipeline"
    cli("pipeline", str(cfg_path), "--out", str(out), threads=a.threads, capture=False)
    summ = read_summary(out)
    res = {
        **header(),
        "protocol": {
            "recipe": str(RECIPE.relative_to(ROOT)),
            "budget": a.budget,
            "stages": recipe(user, a.budget)["stages"],
            "user_folder": "train/ 2000 + val/ 1000 PNGs (no test/), drawn from Fashion-MNIST's test split",
            "held_out_folder": "test/ 1000 PNGs of the same classes, disjoint from the user folder",
            "seed": a.seed,
        },
        "splits": None if summ.splits is None else summ.splits.without_images().to_dict(),  # (the digest names them)
        "summary": {
            k: {f: getattr(m, f) for f in ("test_top1", "test_n", "methods")}
            for k, m in (("dense", summ.dense), ("final", summ.final))
        }
        | {"flops_ratio": summ.comparison.flops_ratio},
        "held_out": held_out_scores(out, held, a.threads),
    }
    save(a.out, res)
    print(json.dumps({"splits": res["splits"], "summary": res["summary"], "held_out": res["held_out"]}, indent=1))


if __name__ == "__main__":
    main()
