"""The Optuna outer search, measured (the search issue's bench).

* ``--part speed``: zero-shot trials per minute of ``search tokens`` (EViT space) on the
  Fashion-MNIST base with 1 and with 2 worker processes (fresh studies, wall time of the run).
* ``--part hv``: the Pareto front of ``--trials`` trials of ``search tokens`` (NSGA-II, the
  uncompressed and paper configurations first) against a grid of the same size over the same
  space (``Space.grid``: a rank-1 lattice, every parameter spread evenly), both scored by the same
  objective (accuracy on the same validation subset, FLOPs ratio): hypervolume of each front in
  (FLOPs ratio, top-1) with one reference point (FLOPs ratio 1.0, top-1 ``--hv-floor``).
* ``--part pretrained``: on a pretrained base (the DINOv2 ViT-S/14 linear probe of
  ``bench/pretrained.py``), the most accurate trial under ``--max-flops`` found by a constrained
  search (``search tokens --max-flops``, the 12-block EViT space) against the paper's default
  configuration (keep rate at layers 4, 7, 10 of 12) with its keep rate set so that its FLOPs
  equal the found trial's: zero-shot top-1 of both on the same validation subset.

    python bench/search.py --part speed --base runs/base
    python bench/search.py --part hv --base runs/base --trials 50
    python bench/search.py --part pretrained --base runs/pretrained/dense --trials 30
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from _common import hypervolume  # noqa: E402  (puts the repository on sys.path)
import torch  # noqa: E402

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.methods import get_method  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.studies.space_model import load_space  # noqa: E402
from nascompress.studies.trials import SearchJob, make_objective, run_search
from nascompress.studies.trial_context import TrialContext
from nascompress.studies.samplers import make_sampler  # noqa: E402
from nascompress.studies import run_study  # noqa: E402
from nascompress.studies.inspect import load as load_study  # noqa: E402
from nascompress.studies.records import pareto_front, trial_record  # noqa: E402
from nascompress.runs.json_io import write_json  # noqa: E402


def front(study) -> list[dict]:
    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    return [
        {
            "trial": t.number,
            "accuracy": trial_record(t).accuracy,
            "flops_ratio": trial_record(t).flops_ratio,
            "params": dict(t.params),
        }
        for t in pareto_front(done, study.directions)
    ]


def search_job(base: str, space: str, study: str, storage: str, a, **kw) -> SearchJob:
    return SearchJob(
        base=base,
        space=space,
        study=study,
        storage=storage,
        trials=a.trials,
        seed=a.seed,
        eval_images=a.eval_images,
        train_images=a.train_images,
        batch_size=a.batch_size,
        **kw,
    )


def part_speed(a, tmp: Path) -> dict:
    out = {}
    for workers in (1, 2):
        storage = f"sqlite:///{tmp}/speed.db" if workers == 1 else f"journal:{tmp}/speed.journal"
        job = search_job(a.base, a.space, f"speed{workers}", storage, a, workers=workers)
        t0 = time.time()
        res = run_search(job, progress=False)
        wall = time.time() - t0
        study = load_study(job.study, storage)[1]
        trial_s = [trial_record(t).wall_s for t in study.trials if t.state.name == "COMPLETE"]
        out[f"workers_{workers}"] = {
            "trials": res.complete,
            "wall_s": wall,
            "trials_per_minute": 60 * res.complete / wall,
            "median_trial_s": sorted(trial_s)[len(trial_s) // 2],
        }
        print(workers, out[f"workers_{workers}"], flush=True)
    return out


def part_hv(a, tmp: Path) -> dict:
    storage = f"sqlite:///{tmp}/hv.db"
    job = search_job(a.base, a.space, "search", storage, a)
    run_search(job, progress=False)
    searched = load_study("search", storage)[1]
    space = load_space(a.space, model=nascompress.load(a.base))  # ranges sized by the base's depth
    grid = space.grid(a.trials)
    gjob = job.replace(study="grid", enqueue=False, trials=len(grid))
    info = {
        "space": space.to_dict(),
        "space_hash": space.hash(),
        "base_run": a.base,
        "dataset": "grid",
        "job": gjob.to_dict(),
    }
    run_study(
        study_name="grid",
        storage=storage,
        objective_factory=functools.partial(make_objective, gjob.to_dict()),
        n_trials=len(grid),
        directions=["maximize", "minimize"],
        metric_names=["accuracy", "flops_ratio"],
        space_info=info,
        sampler_factory=functools.partial(make_sampler, "nsga2"),
        seed=a.seed,
        enqueue=grid,
        progress=False,
    )
    gridded = load_study("grid", storage)[1]
    res = {"reference_point": {"flops_ratio": 1.0, "top1": a.hv_floor}}
    for name, study in (("search_nsga2", searched), ("grid", gridded)):
        f = front(study)
        res[name] = {
            "trials": sum(t.state.name == "COMPLETE" for t in study.trials),
            "front": f,
            "hypervolume": hypervolume([(p["flops_ratio"], p["accuracy"]) for p in f], 1.0, a.hv_floor),
        }
        print(name, res[name]["trials"], res[name]["hypervolume"], flush=True)
    res["winner"] = max(("search_nsga2", "grid"), key=lambda k: res[k]["hypervolume"])
    return res


def part_pretrained(a, tmp: Path) -> dict:
    storage = f"sqlite:///{tmp}/pre.db"
    job = search_job(a.base, a.space, "pretrained", storage, a, max_flops=a.max_flops)
    t0 = time.time()
    run_search(job, progress=False)
    wall = time.time() - t0
    study = load_study("pretrained", storage)[1]
    best = study.best_trial  # the most accurate feasible trial
    rec = trial_record(best)
    # the paper's configuration (EViT at layers 4, 7, 10 of 12, one keep rate) at the same FLOPs
    ctx = TrialContext(job.replace(max_flops=None))
    target = rec.flops_ratio
    lo, hi = 0.05, 1.0
    for _ in range(20):
        kr = (lo + hi) / 2
        m, _ = get_method("evit").prepare_fresh(copy.deepcopy(ctx.base), {"keep_rate": kr, "prune_layers": [4, 7, 10]})
        r = count_flops(m.eval(), ctx.flops_x).total / ctx.dense_flops
        lo, hi = (kr, hi) if r < target else (lo, kr)
    m, _ = get_method("evit").prepare_fresh(copy.deepcopy(ctx.base), {"keep_rate": kr, "prune_layers": [4, 7, 10]})
    paper = {
        "keep_rate": kr,
        "prune_layers": [4, 7, 10],
        "flops_ratio": count_flops(m.eval(), ctx.flops_x).total / ctx.dense_flops,
        "accuracy": ctx.accuracy(m),
    }
    uncompressed = ctx.accuracy(ctx.base)
    return {
        "max_flops": a.max_flops,
        "trials": sum(t.state.name == "COMPLETE" for t in study.trials),
        "wall_s": wall,
        "best_trial": {
            "number": best.number,
            "params": dict(best.params),
            "arch": rec.arch,
            "flops_ratio": rec.flops_ratio,
            "accuracy": rec.accuracy,
        },
        "paper_default_same_flops": paper,
        "uncompressed_accuracy": uncompressed,
        "search_minus_paper_points": rec.accuracy - paper["accuracy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("speed", "hv", "pretrained"), required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--space", default=None, help="default: the shipped evit (evit-12 for pretrained)")
    ap.add_argument("--trials", type=int, default=None, help="default: 20 (speed), 50 (hv), 30 (pretrained)")
    ap.add_argument("--eval-images", type=int, default=2000)
    ap.add_argument("--train-images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-flops", type=float, default=0.6)
    ap.add_argument("--hv-floor", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/search.json")
    a = ap.parse_args()
    a.space = a.space or ("evit-12" if a.part == "pretrained" else "evit")  # shipped spaces, by name
    a.trials = a.trials or {"speed": 20, "hv": 50, "pretrained": 30}[a.part]
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="nascompress-bench-") as tmp:
        part = {"speed": part_speed, "hv": part_hv, "pretrained": part_pretrained}[a.part](a, Path(tmp))
    res[a.part] = dict(
        part,
        command=" ".join(sys.argv),
        base=a.base,
        space=a.space,
        eval_images=a.eval_images,
        machine={"cpu_threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, res)
    print(json.dumps(res[a.part], indent=1)[:3000])


if __name__ == "__main__":
    main()
