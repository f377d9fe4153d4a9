"""Which ``--sampler`` finds the best model in the trials a user can afford (issue: samplers measured).

For every base x space x sampler x seed, a study of ``--trials`` zero-shot trials is run the way
``search tokens`` runs it (the uncompressed and the papers' configurations first, the search's own
objective: top-1 on one fixed class-balanced validation subset, FLOPs ratio to the dense model);
then, for each trial budget (the first 10, 20, 30, 50 trials):

* ``hypervolume``: area dominated by the accuracy x FLOPs-ratio front within
  [0, 1] x [floor, 100] (floor: ``--hv-floor``, default chance level), the reference of
  ``bench/search.py``;
* ``best_under_goal``: the best top-1 among trials at <= ``--goal`` (0.6) x the dense FLOPs.

Fairness: the seed of a study drives only its sampler (``run_study(seed=...)``); the objective
(evaluation subset, trial training seeds) is the same job for every sampler and seed, and a
configuration is scored once per base and space and reused (zero-shot scores of EViT and ToMe are
deterministic; a DynamicViT configuration keeps the score of its first calibration). A sampler that
refuses a space (gp: numeric spaces only; qmc: unconditional spaces only) is recorded as refused,
with its one-line reason.

The summary per base and space: the mean over seeds of each metric per budget, the sampler with the
highest mean hypervolume at 30 trials, and for every sampler whether it reaches >= 99% of the best
hypervolume any sampler found at the largest budget, within 30 trials, on every seed (the issue's goal).

    python bench/samplers.py --base fmnist=runs/base --base dinov2=runs/pretrained/dense \\
        --spaces evit,dynamicvit,tome,joint --seeds 0,1,2 --trials 50
    python bench/samplers.py --make-base runs/bench_tiny ...   # train a small base first (see --help)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (the repository's nascompress first on sys.path)
from _common import header, hypervolume, relative_paths, save

import optuna  # noqa: E402

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.data import DataConfig  # noqa: E402
from nascompress.errors import NascompressError  # noqa: E402
from nascompress.models.build import custom_vit_spec  # noqa: E402
from nascompress.runs.io import load  # noqa: E402
from nascompress.studies.space_model import load_space  # noqa: E402
from nascompress.studies.samplers import SAMPLERS, sampler_factory
from nascompress.studies.trials import SearchJob, make_objective
from nascompress.studies.space_reference import reference_configs  # noqa: E402
from nascompress.studies import run_study  # noqa: E402
from nascompress.studies.records import trial_record  # noqa: E402
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, train  # noqa: E402

BUDGETS = (10, 20, 30, 50)
SPACES = {
    "evit": "evit",
    "dynamicvit": "dynamicvit",
    "tome": "tome",
    "joint": "joint",
    "evit-12": "evit-12",
}  # shipped spaces, by name (nascompress/search_spaces/)

# (base, space) -> {config key: (accuracy, flops_ratio, record)}: each configuration scored once
_CACHE: dict[str, dict[str, tuple[Any, dict[str, Any]]]] = {}
_INNER: dict[str, Any] = {}


class CachedObjective:
    """The search's objective, scoring each configuration once per (base, space) (see the module
    docstring): the trial's configuration is suggested first, a known one is answered from the cache."""

    def __init__(self, job_dict: dict[str, Any], cache_key: str):
        # one objective per (base, space) for every sampler and seed: its worker state (the base, the
        # data, a joint space's searched DCS stages) is built once; the job differs only in its study name
        if cache_key not in _INNER:
            _INNER[cache_key] = make_objective(job_dict)
        self.inner = _INNER[cache_key]
        self.space = load_space(job_dict["space"], model=nascompress.load(job_dict["base"]))
        self.cache = _CACHE.setdefault(cache_key, {})

    def __call__(self, trial: Any) -> Any:
        key = json.dumps(self.space.suggest(trial), sort_keys=True)
        if key not in self.cache:
            values = self.inner(trial)
            self.cache[key] = (values, dict(trial.user_attrs))
        values, attrs = self.cache[key]
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        return values


def cached_objective_factory(job_dict: dict[str, Any], cache_key: str) -> CachedObjective:
    return CachedObjective(job_dict, cache_key)


def budget_metrics(trials: list[tuple[float, float]], budget: int, *, floor: float, goal: float) -> dict[str, Any]:
    """Hypervolume and best accuracy under the goal of the first ``budget`` (accuracy, ratio) trials."""
    first = trials[:budget]
    under = [a for a, r in first if r <= goal]
    return {
        "trials": len(first),
        "hypervolume": hypervolume([(r, a) for a, r in first], 1.0, floor),
        "best_under_goal": max(under) if under else None,
    }


def run_one(base: str, space_path: str, sampler: str, seed: int, a, storage: str) -> dict[str, Any]:
    space = load_space(space_path, model=nascompress.load(base))  # layer ranges sized by the base's depth
    try:
        factory = sampler_factory(sampler, space, seed, trials=a.trials)
    except NascompressError as e:
        return {"refused": str(e)}
    job = SearchJob(
        base=base,
        space=space_path,
        study=f"{sampler}-{seed}",
        storage=storage,
        trials=a.trials,
        sampler=sampler,
        eval_images=a.eval_images,
        train_images=a.train_images,
        calib_steps=a.calib_steps,
        batch_size=a.batch_size,
        seed=a.job_seed,
    )
    enqueue = [p for _, p in reference_configs(space, load(base))]
    job_dict = job.to_dict()
    t0 = time.time()
    run_study(
        study_name=job.study,
        storage=storage,
        objective_factory=functools.partial(cached_objective_factory, job_dict, f"{base}|{space_path}"),
        n_trials=a.trials,
        directions=["maximize", "minimize"],
        metric_names=["accuracy", "flops_ratio"],
        space_info={"space": space.to_dict(), "space_hash": space.hash(), "sampler": sampler},
        sampler_factory=factory,
        seed=seed,
        enqueue=enqueue,
        progress=False,
    )
    study = optuna.load_study(study_name=job.study, storage=storage)
    done = sorted((t for t in study.trials if t.state.name == "COMPLETE"), key=lambda t: t.number)
    pts = [(float(trial_record(t).accuracy), float(trial_record(t).flops_ratio)) for t in done]
    return {
        "wall_s": time.time() - t0,
        "trials": [{"accuracy": acc, "flops_ratio": r} for acc, r in pts],
        "budgets": {str(b): budget_metrics(pts, b, floor=a.hv_floor, goal=a.goal) for b in a.budgets},
    }


def summarize(runs: dict[str, dict[str, dict[str, Any]]], budgets: list[int]) -> dict[str, Any]:
    """Per sampler: the mean over seeds per budget; the best at 30; the 99%-of-best goal."""
    out: dict[str, Any] = {"mean": {}}
    top = str(max(budgets))
    best_hv = max(
        (r["budgets"][top]["hypervolume"] for per in runs.values() for r in per.values() if "budgets" in r),
        default=None,
    )
    goal_met = {}
    for sampler, per in runs.items():
        ok = [r for r in per.values() if "budgets" in r]
        if not ok:
            out["mean"][sampler] = {"refused": next(iter(per.values()))["refused"]}
            continue
        out["mean"][sampler] = {}
        for b in budgets:
            hvs = [r["budgets"][str(b)]["hypervolume"] for r in ok]
            bests = [r["budgets"][str(b)]["best_under_goal"] for r in ok]
            out["mean"][sampler][str(b)] = {
                "hypervolume": sum(hvs) / len(hvs),
                "best_under_goal": (
                    sum(v for v in bests if v is not None) / len([v for v in bests if v is not None])
                    if any(v is not None for v in bests)
                    else None
                ),
                "seeds_with_a_trial_under_goal": sum(v is not None for v in bests),
            }
        if best_hv is not None and "30" in ok[0]["budgets"]:
            goal_met[sampler] = all(r["budgets"]["30"]["hypervolume"] >= 0.99 * best_hv for r in ok)
    ranked = [s for s in out["mean"] if "refused" not in out["mean"][s] and "30" in out["mean"][s]]
    if ranked:  # every sampler within float noise of the highest mean hypervolume at 30 trials
        top30 = max(out["mean"][s]["30"]["hypervolume"] for s in ranked)
        out["best_at_30"] = [s for s in ranked if out["mean"][s]["30"]["hypervolume"] >= top30 - 1e-9]
    out["best_hypervolume_at_%s" % top] = best_hv
    out["reaches_99pct_of_best_within_30_on_every_seed"] = goal_met
    return out


def make_base(out: Path, a) -> str:
    """A small Fashion-MNIST base of the README main job's architecture (28 px, patch 4, width 96,
    depth 6, 3 heads), trained ``--base-epochs`` on ``--base-train-images`` images."""
    if (out / "metrics.json").is_file():
        return str(out)
    job = TrainJob(
        model=custom_vit_spec(
            img_size=28, patch_size=4, embed_dim=96, depth=6, num_heads=3, num_classes=10, in_chans=1
        ),
        data=DataConfig(dataset="fashion-mnist", train_limit=a.base_train_images, eval_limit=2000),
        train=TrainConfig(epochs=a.base_epochs, batch_size=128, lr=1e-3, seed=0),
        out=str(out),
    )
    train(job)
    return str(out)


def resummarize(path: str) -> None:
    """Recompute the summaries of a result file from its runs (after a change to :func:`summarize`)."""
    res = json.loads(Path(path).read_text())
    for spaces in res["results"].values():
        for r in spaces.values():
            r["summary"] = summarize(r["runs"], res["settings"]["budgets"])
    save(path, res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resummarize", default=None, help="only recompute the summaries of this result file")
    ap.add_argument("--base", action="append", default=[], help="NAME=RUN_DIR (repeatable)")
    ap.add_argument("--make-base", default=None, help="train a small Fashion-MNIST base here first (added as 'tiny')")
    ap.add_argument("--base-epochs", type=int, default=1)
    ap.add_argument("--base-train-images", type=int, default=12000)
    ap.add_argument("--spaces", default="evit,dynamicvit,tome,joint", help=f"names of {sorted(SPACES)} or yaml paths")
    ap.add_argument("--samplers", default=",".join(SAMPLERS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--eval-images", type=int, default=2000)
    ap.add_argument("--train-images", type=int, default=2000)
    ap.add_argument("--calib-steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--job-seed", type=int, default=0, help="the objective's seed (subsets, trial training)")
    ap.add_argument("--goal", type=float, default=0.6)
    ap.add_argument("--hv-floor", type=float, default=10.0, help="the hypervolume's accuracy floor (chance: 10)")
    ap.add_argument("--out", default="bench/results/samplers.json")
    a = ap.parse_args()
    if a.resummarize:
        return resummarize(a.resummarize)
    a.budgets = [b for b in map(int, a.budgets.split(",")) if b <= a.trials]
    bases = dict(b.split("=", 1) for b in a.base)
    if a.make_base:
        bases["tiny"] = make_base(Path(a.make_base), a)
    if not bases:
        ap.error("give --base NAME=RUN_DIR or --make-base DIR")
    spaces = [s.strip() for s in a.spaces.split(",") if s.strip()]
    samplers = [s.strip() for s in a.samplers.split(",") if s.strip()]
    seeds = [int(s) for s in a.seeds.split(",")]
    res: dict[str, Any] = {
        **header(),
        "complete": False,
        "settings": {
            "trials": a.trials,
            "budgets": a.budgets,
            "seeds": seeds,
            "samplers": samplers,
            "eval_images": a.eval_images,
            "train_images": a.train_images,
            "calib_steps": a.calib_steps,
            "goal_flops": a.goal,
            "hv_floor": a.hv_floor,
            "hv_reference_flops_ratio": 1.0,
            "job_seed": a.job_seed,
            "bases": {k: v for k, v in bases.items()},
            "made_base": None
            if not a.make_base
            else {
                "epochs": a.base_epochs,
                "train_images": a.base_train_images,
                "arch": "custom ViT 28 px, patch 4, width 96, depth 6, 3 heads",
            },
        },
        "results": {},
    }
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="nascompress-samplers-") as tmp:
        for bname, base in bases.items():
            for sname in spaces:
                path = SPACES.get(sname, sname)
                storage = f"sqlite:///{tmp}/{bname}-{Path(path).stem}.db"
                runs: dict[str, dict[str, Any]] = {s: {} for s in samplers}
                for i, seed in enumerate(seeds):  # seed by seed: a cut-short space still compares every sampler
                    for sampler in samplers:
                        r = run_one(base, path, sampler, seed, a, storage)
                        runs[sampler][str(seed)] = r
                        msg = r.get("refused") or {b: round(m["hypervolume"], 2) for b, m in r["budgets"].items()}
                        print(f"{bname} {sname} {sampler} seed {seed}: {msg}", flush=True)
                        res["results"].setdefault(bname, {})[sname] = {
                            "space": path,
                            "configurations_scored": len(_CACHE.get(f"{base}|{path}", {})),
                            "seeds_done": seeds[:i] + ([seed] if sampler == samplers[-1] else []),
                            "summary": summarize({k: v for k, v in runs.items() if v}, a.budgets),
                            "runs": runs,
                        }
                        res["wall_s"] = time.time() - t_all
                        save(a.out, relative_paths(res))  # after every run: a cut-short bench keeps what it measured
                print(json.dumps(res["results"][bname][sname]["summary"], indent=1), flush=True)
    res["complete"] = True
    save(a.out, relative_paths(res))


if __name__ == "__main__":
    sys.exit(main())
