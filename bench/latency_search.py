"""FLOPs or latency as the DCS search's cost, on the README main job's base: what each buys in measured speed
and costs in accuracy.

One dense base (``configs/fashion-mnist.yaml``'s ``base.train``, or ``--base RUN``), then one ``search dcs``
per arm, each materialized and timed interleaved with the base (``nascompress profile --compare``: batch 1
and a serving batch), with the search's validation and test top-1 before any retraining:

* ``flops_0.6``: the main job's DCS stage as shipped (``--target-flops 0.6``, static Q/K, ``--round-mlp 32``);
* ``latency_R`` (``--targets``): ``--cost latency --target-latency R`` with ``--head-gates --depth-gates``
  (the latency table of this machine at batch 1, fp32; its predicted ratio is recorded beside the measured
  one).

    python bench/latency_search.py                       # base + 3 arms, about 12 minutes on 2 cores
    python bench/latency_search.py --base runs/demo/base --targets 0.6

Writes ``bench/results/latency_search_<cpu>.json``. Run it on a quiet machine: the latency tables and
the speed-ups are measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import ROOT, header, save, slug  # noqa: E402  (puts the repository on sys.path)
from _standins import main_job_spec  # noqa: E402

from nascompress.data import DataConfig  # noqa: E402
from nascompress.pipeline import load_config  # noqa: E402
from nascompress.profiling.latency_table import cpu_info  # noqa: E402
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, train  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402


def cli(*args: Any, env: dict[str, str]) -> str:
    cmd = [sys.executable, "-m", "nascompress.cli.main", *map(str, args)]
    return subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, text=True).stdout


def base_run(work: Path, a: argparse.Namespace) -> Path:
    """The dense base: ``--base``, or the main job's base trained into ``work/base`` once."""
    if a.base:
        return Path(a.base)
    out = work / "base"
    if not (out / "metrics.json").is_file():
        t = load_config(ROOT / "configs" / "fashion-mnist.yaml").base.train
        train(
            TrainJob(
                model=main_job_spec(),
                data=DataConfig(dataset="fashion-mnist"),
                out=str(out),
                train=TrainConfig(epochs=t.epochs, batch_size=t.batch_size, lr=t.lr, seed=a.seed),
            ),
            force=True,
        )
    return out


def arm(name: str, options: list[str], base: Path, work: Path, a: argparse.Namespace, env: dict) -> dict[str, Any]:
    s, m = work / name, work / f"{name}_mat"
    common = ["--qk-mask", "static", "--round-mlp", 32, "--epochs", a.epochs, "--train-limit", a.train_limit]
    cli("search", "dcs", base, "--out", s, *options, *common, "--seed", a.seed, "--force", env=env)
    cli("materialize", s, "--out", m, "--force", env=env)
    prof = json.loads(
        cli("profile", m, "--compare", base, "--iters", a.iters, "--batch-size", a.batch, "--json", env=env)
    )
    met = read_json(s / "metrics.json")
    c = prof["comparison"]
    return {
        "options": " ".join(map(str, options)),
        "flops_ratio": c["flops_ratio"],
        "latency_speedup_batch1": c["latency_speedup"],
        f"throughput_speedup_batch{a.batch}": c["throughput_speedup"],
        "measured_latency_ratio": 1 / c["latency_speedup"],
        "predicted_latency_ratio": met.get("latency_ratio"),
        "val_top1": met["val_top1"],
        "test_top1": met["test_top1"],
        "dense_val_top1": met.get("dense_val_top1"),
        "heads_kept": met.get("heads_kept"),
        "skipped_blocks": met.get("skipped_blocks"),
        "mlp_kept": met.get("mlp_kept"),
        "kept": met.get("kept"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="a dense run (default: train the main job's base)")
    ap.add_argument("--work", default="runs/bench_latency_search", help="where the runs go")
    ap.add_argument("--targets", nargs="+", type=float, default=[0.6, 0.7], help="the latency arms' targets")
    ap.add_argument("--epochs", type=int, default=2, help="search epochs (the main job's DCS stage: 2)")
    ap.add_argument("--train-limit", type=int, default=24000, help="search images (the main job's: 24000)")
    ap.add_argument("--iters", type=int, default=30, help="timed rounds of the speed comparison")
    ap.add_argument("--batch", type=int, default=64, help="the serving batch of the comparison")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: bench/results/latency_search_<cpu>.json")
    a = ap.parse_args(argv)
    work = (ROOT / a.work).resolve()
    env = dict(os.environ, NASCOMPRESS_PROGRESS="plain", NASCOMPRESS_CACHE=str(work / "cache"), PYTHONPATH=str(ROOT))
    base = base_run(work, a)
    result: dict[str, Any] = {**header(), "base": str(base), "arms": {}}
    arms = [("flops_0.6", ["--target-flops", 0.6])] + [
        (f"latency_{t:g}", ["--cost", "latency", "--target-latency", t, "--head-gates", "--depth-gates"])
        for t in a.targets
    ]
    for name, options in arms:
        result["arms"][name] = arm(name, options, base, work, a, env)
        print(name, json.dumps(result["arms"][name]), flush=True)
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"latency_search_{slug(cpu_info()[0])}.json"
    save(out, result)
    print(f"-> {out}")
    return result


if __name__ == "__main__":
    main()
